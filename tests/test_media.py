"""Writers in omni_diffusion_rl.media: WAV, GIF, PNG, contact sheets and preview folders."""

from __future__ import annotations

import json
import os
import wave
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageSequence

from omni_diffusion_rl.media import (
    SHEET_GAP,
    MediaBatch,
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


def test_save_previews_video_and_audio(tmp_path: Path) -> None:
    video = torch.rand(2, 3, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    audio = torch.rand(2, 1, 400, generator=torch.Generator().manual_seed(2)) * 2 - 1
    media = MediaBatch(video=video, audio=audio, fps=4.0, sample_rate=8000)
    prompts = ["a red ball", "a blue square"]
    rewards = {"reward/mean": [0.25, 0.75], "reward/color_match": torch.tensor([0.5, 1.0])}
    paths = save_previews(tmp_path / "step_0001", media, prompts, rewards)

    expected = {"sheet.png", "sample_00.gif", "sample_01.gif", "sample_00.wav", "sample_01.wav", "index.json"}
    assert set(paths) == expected
    folder = tmp_path / "step_0001"
    assert sorted(os.listdir(folder)) == sorted(expected)  # no temp files left behind
    for name, path in paths.items():
        assert Path(path) == folder / name and Path(path).stat().st_size > 0

    index = json.loads((folder / "index.json").read_text())
    assert index["prompts"] == prompts
    assert index["rewards"] == {"reward/mean": [0.25, 0.75], "reward/color_match": [0.5, 1.0]}
    assert index["sheet"] == "sheet.png"
    assert index["samples"][1] == {
        "index": 1,
        "prompt": "a blue square",
        "rewards": {"reward/mean": 0.75, "reward/color_match": 1.0},
        "gif": "sample_01.gif",
        "wav": "sample_01.wav",
    }
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
