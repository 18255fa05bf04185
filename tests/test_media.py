"""Writers in omni_diffusion_rl.media: WAV, GIF, PNG, contact sheets and preview folders."""

from __future__ import annotations

import json
import math
import os
import wave
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from omni_diffusion_rl.media import (
    DEFAULT_REFERENCE_TITLE,
    REFERENCE_GAP,
    SHEET_BACKGROUND,
    SHEET_GAP,
    MediaBatch,
    _reward_label,
    atomic_write,
    contact_sheet,
    save_gif,
    save_png,
    save_previews,
    save_wav,
)


def _solid_frames(colours: list[tuple[float, float, float]], size: int = 16) -> torch.Tensor:
    """[F, 3, size, size] frames, each filled with one RGB colour."""
    return torch.stack([torch.tensor(c).view(3, 1, 1).expand(3, size, size) for c in colours]).float()


def test_save_wav_round_trip(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    waveform = torch.rand(2, 1234, generator=generator) * 2.4 - 1.2  # some values outside [-1, 1]
    path = save_wav(tmp_path / "a.wav", waveform, 8000)
    with wave.open(path, "rb") as wav:
        assert wav.getframerate() == 8000
        assert wav.getnchannels() == 2
        assert wav.getsampwidth() == 2
        assert wav.getnframes() == 1234
        raw = wav.readframes(wav.getnframes())
    read = np.frombuffer(raw, dtype="<i2").reshape(1234, 2).T.astype(np.float64) / 32767.0
    expected = waveform.clamp(-1, 1).double().numpy()
    assert np.abs(read - expected).max() <= 1.0 / 32767.0
    assert read.max() <= 1.0 and read.min() >= -1.0


def test_save_wav_mono_vector(tmp_path: Path) -> None:
    path = save_wav(tmp_path / "m.wav", torch.zeros(500), 16000)
    with wave.open(path, "rb") as wav:
        assert (wav.getnchannels(), wav.getnframes(), wav.getframerate()) == (1, 500, 16000)


def test_save_gif_frames_size_and_colour(tmp_path: Path) -> None:
    frames = _solid_frames([(1, 0, 0), (0, 1, 0), (0, 0, 1)])
    frames[1, :, 0, 0] = torch.tensor([1.0, 1.0, 1.0])  # one white source pixel in frame 1
    path = save_gif(tmp_path / "clip.gif", frames, fps=8, scale=8)
    with Image.open(path) as gif:
        assert gif.format == "GIF"
        assert gif.info.get("loop") == 0
        assert gif.info.get("duration") == 120  # 1/8 s to whole hundredths
        decoded = [frame.convert("RGB") for frame in ImageSequence.Iterator(gif)]
    assert len(decoded) == 3
    assert all(frame.size == (128, 128) for frame in decoded)
    assert decoded[0].getpixel((50, 70)) == (255, 0, 0)
    assert decoded[2].getpixel((127, 127)) == (0, 0, 255)
    # Nearest-neighbour: the white source pixel covers exactly the top-left 8x8 block.
    assert decoded[1].getpixel((7, 7)) == (255, 255, 255)
    assert decoded[1].getpixel((8, 8)) == (0, 255, 0)


def test_save_png(tmp_path: Path) -> None:
    image = torch.zeros(3, 5, 7)
    image[2] = 1.0
    image[:, 4, 6] = 0.5
    path = save_png(tmp_path / "x.png", image)
    with Image.open(path) as png:
        assert png.format == "PNG"
        assert png.size == (7, 5)
        assert png.convert("RGB").getpixel((0, 0)) == (0, 0, 255)
        assert png.convert("RGB").getpixel((6, 4)) == (128, 128, 128)


def test_contact_sheet_layout() -> None:
    batch, num_frames, scale = 3, 4, 8
    video = torch.zeros(batch, num_frames, 3, 16, 16)
    video[1, 2] = 1.0  # sample 1, frame 2 white
    sheet = contact_sheet(video, scale=scale)
    tile = 16 * scale
    assert sheet.size == (
        num_frames * tile + (num_frames + 1) * SHEET_GAP,
        batch * tile + (batch + 1) * SHEET_GAP,
    )
    left = SHEET_GAP + 2 * (tile + SHEET_GAP)
    top = SHEET_GAP + 1 * (tile + SHEET_GAP)
    assert sheet.getpixel((left + tile // 2, top + tile // 2)) == (255, 255, 255)
    assert sheet.getpixel((left - SHEET_GAP - 1, top + tile // 2)) == (0, 0, 0)

    labelled = contact_sheet(video, labels=["a", "b", "c"], scale=scale)
    assert labelled.width == sheet.width
    assert labelled.height > sheet.height
    wide = contact_sheet(video, labels=["x" * 400, "b", "c"], scale=scale)
    assert wide.width > sheet.width


def test_contact_sheet_rejects_wrong_label_count() -> None:
    with pytest.raises(ValueError):
        contact_sheet(torch.zeros(2, 1, 3, 4, 4), labels=["only one"])


def _solid_video(batch: int, frames: int, colour: tuple[float, float, float], size: int = 4) -> torch.Tensor:
    """[batch, frames, 3, size, size] video, every pixel one RGB colour."""
    return _solid_frames([colour] * frames, size).unsqueeze(0).repeat(batch, 1, 1, 1, 1)


def test_contact_sheet_reference_left_of_samples() -> None:
    batch, num_frames, ref_frames, scale, size = 2, 3, 2, 4, 4
    video = _solid_video(batch, num_frames, (0, 1, 0), size)  # green samples
    reference = _solid_video(batch, ref_frames, (1, 0, 0), size)  # red references
    plain = contact_sheet(video, scale=scale)
    sheet = contact_sheet(video, scale=scale, reference=reference)
    tile = size * scale
    assert sheet.height == plain.height
    assert sheet.width - plain.width >= ref_frames * tile + REFERENCE_GAP
    assert sheet.width == plain.width + ref_frames * (tile + SHEET_GAP) - SHEET_GAP + REFERENCE_GAP
    assert REFERENCE_GAP > SHEET_GAP

    sample_left = SHEET_GAP + ref_frames * (tile + SHEET_GAP) - SHEET_GAP + REFERENCE_GAP
    for row in range(batch):
        middle = SHEET_GAP + row * (tile + SHEET_GAP) + tile // 2
        for col in range(ref_frames):
            assert sheet.getpixel((SHEET_GAP + col * (tile + SHEET_GAP) + tile // 2, middle)) == (255, 0, 0)
        for col in range(num_frames):
            assert sheet.getpixel((sample_left + col * (tile + SHEET_GAP) + tile // 2, middle)) == (0, 255, 0)
        # The wide gap between the blocks is background, up to the first sample pixel.
        for x in range(sample_left - REFERENCE_GAP, sample_left):
            assert sheet.getpixel((x, middle)) == SHEET_BACKGROUND
        assert sheet.getpixel((sample_left, middle)) == (0, 255, 0)
        assert sheet.getpixel((sample_left - REFERENCE_GAP - 1, middle)) == (255, 0, 0)


def test_contact_sheet_title() -> None:
    video = torch.zeros(2, 2, 3, 4, 4)
    plain = contact_sheet(video, scale=4)
    titled = contact_sheet(video, scale=4, title="left: reference; right: sample")
    assert titled.height > plain.height
    assert contact_sheet(video, scale=4, title="").size == plain.size
    long = contact_sheet(video, scale=4, title="x" * 300)
    assert long.width > plain.width
    # The tiles move down by the title band: the bottom row still ends SHEET_GAP above the bottom edge.
    video[-1, 0] = 1.0
    titled = contact_sheet(video, scale=4, title="a title")
    assert titled.getpixel((SHEET_GAP, titled.height - SHEET_GAP - 1)) == (255, 255, 255)
    assert titled.getpixel((SHEET_GAP, titled.height - 1)) == SHEET_BACKGROUND


@pytest.mark.parametrize(
    "reference",
    [
        torch.zeros(3, 1, 3, 4, 4),  # batch mismatch
        torch.zeros(2, 3, 4, 4),  # wrong ndim
        torch.zeros(2, 1, 3, 5, 4),  # height mismatch
        torch.zeros(2, 1, 3, 4, 6),  # width mismatch
        torch.zeros(2, 1, 1, 4, 4),  # not RGB
        torch.zeros(2, 0, 3, 4, 4),  # no frames
    ],
)
def test_contact_sheet_rejects_bad_reference(reference: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        contact_sheet(torch.zeros(2, 2, 3, 4, 4), reference=reference)


def test_contact_sheet_rejects_bad_video() -> None:
    with pytest.raises(ValueError):
        contact_sheet(torch.zeros(2, 3, 4, 4))
    with pytest.raises(ValueError):
        contact_sheet(torch.zeros(2, 1, 4, 4, 4))


def test_save_previews_failed_scores(tmp_path: Path) -> None:
    media = MediaBatch(video=torch.rand(3, 2, 3, 8, 8, generator=torch.Generator().manual_seed(3)))
    prompts = ["a red ball", "a blue square", "a green dot"]
    rewards = {"reward": [0.5, None, math.nan], "reward/color": torch.tensor([math.nan, 0.25, math.inf])}
    metrics = {
        "metric/psnr": [None, 21.234, -math.inf],
        "metric/ssim": torch.tensor([0.75, math.nan, 0.5]),
    }
    paths = save_previews(tmp_path, media, prompts, rewards, metrics)

    def no_constants(token: str) -> object:
        raise AssertionError(f"index.json holds {token}, which is not JSON")

    index = json.loads(Path(paths["index.json"]).read_text(), parse_constant=no_constants)
    assert index["rewards"] == {"reward": [0.5, None, None], "reward/color": [None, 0.25, None]}
    assert index["metrics"] == {"metric/psnr": [None, 21.234, None], "metric/ssim": [0.75, None, 0.5]}
    assert [sample["metrics"] for sample in index["samples"]] == [
        {"metric/psnr": None, "metric/ssim": 0.75},
        {"metric/psnr": 21.234, "metric/ssim": None},
        {"metric/psnr": None, "metric/ssim": 0.5},
    ]
    assert index["samples"][0]["rewards"] == {"reward": 0.5, "reward/color": None}
    assert index["reference"] is False and "reference_gif" not in index["samples"][0]

    reward_lists = {name: index["rewards"][name] for name in rewards}
    metric_lists = {name: index["metrics"][name] for name in metrics}
    assert _reward_label(0, prompts[0], reward_lists, metric_lists) == (
        "00 a red ball\nreward=0.500  reward/color=failed\npsnr=failed  ssim=0.75"
    )
    assert _reward_label(1, prompts[1], reward_lists, metric_lists) == (
        "01 a blue square\nreward=failed  reward/color=0.250\npsnr=21.23  ssim=failed"
    )
    # NaN passed straight to the label (not through save_previews) also reads "failed".
    assert _reward_label(0, "p", {"r": [math.nan]}, {"m": [math.inf]}) == "00 p\nr=failed\nm=failed"
    # No metrics: two lines as before; no rewards either: the prompt alone; metrics alone: two lines.
    assert _reward_label(2, "p", {"r": [0, 0, 1.0]}) == "02 p\nr=1.000"
    assert _reward_label(0, "p", {}) == "00 p"
    assert _reward_label(0, "p", {}, {"a/b": [0.125]}) == "00 p\nb=0.12"


def test_sheet_names_keep_full_name_when_short_names_collide() -> None:
    label = _reward_label(0, "p", {}, {"a/score": [1.0], "b/score": [2.0], "x/psnr": [3.0], "ends/": [4.0]})
    assert label == "00 p\na/score=1.00  b/score=2.00  psnr=3.00  ends/=4.00"


def test_save_previews_metrics_widen_sheet(tmp_path: Path) -> None:
    media = MediaBatch(video=torch.zeros(1, 1, 3, 2, 2))
    plain = save_previews(tmp_path / "plain", media, ["p"], {"r": [1.0]})
    metrics = {f"metric/long_metric_name_{k}": [float(k)] for k in range(6)}
    measured = save_previews(tmp_path / "measured", media, ["p"], {"r": [1.0]}, metrics)
    with Image.open(plain["sheet.png"]) as a, Image.open(measured["sheet.png"]) as b:
        assert b.height > a.height  # a third label line
        assert b.width > a.width  # widened to fit it


def test_save_previews_with_reference(tmp_path: Path) -> None:
    batch, num_frames, ref_frames, size = 2, 2, 3, 16
    media = MediaBatch(video=_solid_video(batch, num_frames, (0, 1, 0), size), fps=4.0)
    reference = _solid_video(batch, ref_frames, (1, 0, 0), size)
    prompts = ["a", "b"]
    plain = save_previews(tmp_path / "plain", media, prompts, {"r": [0.5, None]})
    paths = save_previews(tmp_path / "ref", media, prompts, {"r": [0.5, None]}, reference=reference)

    assert set(paths) == set(plain) | {"reference_00.gif", "reference_01.gif"}
    assert sorted(os.listdir(tmp_path / "ref")) == sorted(paths)
    with Image.open(paths["reference_01.gif"]) as gif:
        assert gif.size == (size * 8, size * 8)
        assert gif.convert("RGB").getpixel((5, 5)) == (255, 0, 0)
    index = json.loads(Path(paths["index.json"]).read_text())
    assert index["reference"] is True
    assert [sample["reference_gif"] for sample in index["samples"]] == [
        "reference_00.gif",
        "reference_01.gif",
    ]
    assert index["samples"][1]["gif"] == "sample_01.gif"

    tile = size * 8
    with Image.open(plain["sheet.png"]) as a, Image.open(paths["sheet.png"]) as b:
        without, with_reference = a.convert("RGB"), b.convert("RGB")
    assert with_reference.width - without.width >= ref_frames * tile + REFERENCE_GAP
    assert with_reference.height > without.height  # the default title
    # The bottom row's tiles end SHEET_GAP above the sheet's bottom edge, whatever the label heights.
    middle = with_reference.height - SHEET_GAP - tile // 2
    assert with_reference.getpixel((SHEET_GAP + tile // 2, middle)) == (255, 0, 0)
    sample_left = SHEET_GAP + ref_frames * (tile + SHEET_GAP) - SHEET_GAP + REFERENCE_GAP
    assert with_reference.getpixel((sample_left + tile // 2, middle)) == (0, 255, 0)
    assert with_reference.getpixel((sample_left - 1, middle)) == SHEET_BACKGROUND


def test_save_previews_reference_title(tmp_path: Path) -> None:
    media = MediaBatch(video=torch.zeros(1, 1, 3, 2, 2))
    reference = torch.ones(1, 1, 3, 2, 2)
    sizes = {}
    for name, title in [
        ("default", None),
        ("same", DEFAULT_REFERENCE_TITLE),
        ("none", ""),
        ("long", "y" * 200),
    ]:
        paths = save_previews(tmp_path / name, media, ["p"], reference=reference, reference_title=title)
        with Image.open(paths["sheet.png"]) as sheet:
            sizes[name] = sheet.size
    assert sizes["default"] == sizes["same"]
    assert sizes["none"][1] < sizes["default"][1]
    assert sizes["long"][0] > sizes["default"][0]


def test_save_previews_rejects_bad_reference_before_writing(tmp_path: Path) -> None:
    media = MediaBatch(video=torch.zeros(2, 1, 3, 4, 4))
    for reference in (torch.zeros(1, 1, 3, 4, 4), torch.zeros(2, 1, 3, 4, 5), torch.zeros(2, 3, 4, 4)):
        with pytest.raises(ValueError):
            save_previews(tmp_path / "out", media, ["a", "b"], reference=reference)
    assert not (tmp_path / "out").exists()


def test_save_previews_reference_with_audio_only(tmp_path: Path) -> None:
    media = MediaBatch(audio=torch.zeros(1, 1, 50))
    paths = save_previews(tmp_path, media, ["a hum"], reference=torch.ones(1, 2, 3, 4, 4))
    assert set(paths) == {"sample_00.wav", "reference_00.gif", "index.json"}
    index = json.loads(Path(paths["index.json"]).read_text())
    assert index["sheet"] is None and index["reference"] is True
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a hum"], reference=torch.ones(2, 2, 3, 4, 4))


def test_save_previews_rejects_non_numbers(tmp_path: Path) -> None:
    media = MediaBatch(audio=torch.zeros(2, 1, 10))
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a", "b"], {"r": [1.0, "bad"]})
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a", "b"], None, {"m": 3.0})
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a", "b"], None, {"m": torch.tensor(3.0)})
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a", "b"], None, {"m": [1.0]})


def test_save_previews_video_and_audio(tmp_path: Path) -> None:
    video = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    audio = torch.rand(2, 1, 400, generator=torch.Generator().manual_seed(2)) * 2 - 1
    media = MediaBatch(video=video, audio=audio, fps=4.0, sample_rate=8000)
    prompts = ["a red ball", "a blue square"]
    rewards = {"reward/mean": [0.25, 0.75], "reward/color_match": torch.tensor([0.5, 1.0])}
    paths = save_previews(tmp_path / "step_0001", media, prompts, rewards)

    expected = {"sheet.png", "index.json"} | {
        f"sample_0{i}.{kind}" for i in (0, 1) for kind in ("gif", "wav", "mp4")
    }
    assert set(paths) == expected
    folder = tmp_path / "step_0001"
    assert sorted(os.listdir(folder)) == sorted(expected)  # no temp files left behind
    for name, path in paths.items():
        assert Path(path) == folder / name and Path(path).stat().st_size > 0

    index = json.loads((folder / "index.json").read_text())
    assert index["prompts"] == prompts
    assert index["rewards"] == {"reward/mean": [0.25, 0.75], "reward/color_match": [0.5, 1.0]}
    assert index["sheet"] == "sheet.png"
    assert index["metrics"] == {} and index["reference"] is False
    assert index["samples"][1] == {
        "index": 1,
        "prompt": "a blue square",
        "rewards": {"reward/mean": 0.75, "reward/color_match": 1.0},
        "metrics": {},
        "gif": "sample_01.gif",
        "wav": "sample_01.wav",
        "mp4": "sample_01.mp4",
    }
    with av.open(paths["sample_01.mp4"]) as clip:  # the sample's picture and its sound, in one file
        assert [s.type for s in clip.streams] == ["video", "audio"]
    with Image.open(paths["sheet.png"]) as sheet:
        assert sheet.width >= 3 * 16 * 8
    with wave.open(paths["sample_00.wav"], "rb") as wav:
        assert wav.getnframes() == 400


def test_save_previews_audio_only(tmp_path: Path) -> None:
    media = MediaBatch(audio=torch.zeros(1, 1, 100), sample_rate=4000)
    paths = save_previews(tmp_path, media, ["a hum"], None)
    assert set(paths) == {"sample_00.wav", "index.json"}
    index = json.loads(Path(paths["index.json"]).read_text())
    assert index["sheet"] is None and "gif" not in index["samples"][0]
    assert index["rewards"] == {}


def test_save_previews_checks_lengths(tmp_path: Path) -> None:
    media = MediaBatch(audio=torch.zeros(2, 1, 10))
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["one prompt"], None)
    with pytest.raises(ValueError):
        save_previews(tmp_path, media, ["a", "b"], {"reward/mean": [1.0]})


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path) -> None:
    target = tmp_path / "f.bin"
    atomic_write(target, lambda handle: handle.write(b"old"))

    def broken(handle) -> None:  # type: ignore[no-untyped-def]
        handle.write(b"half")
        raise RuntimeError("crash mid-write")

    with pytest.raises(RuntimeError):
        atomic_write(target, broken)
    assert target.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["f.bin"]
