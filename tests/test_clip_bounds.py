"""Clips are decoded to the model's size and within bounded work (issue 42): a large clip's frames are
resized one at a time as they are decoded, a stream of frames far faster than any camera (a
frame-count bomb) is refused after a handful of frames, a clip that takes too long is refused, and a
refused file is refused again at once, however many lines name it."""

from __future__ import annotations

import json
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from omni_diffusion_rl.answer_data import clip_files
from omni_diffusion_rl.answer_data.clip_files import (
    ClipFileError,
    ClipFormat,
    decode_video,
    write_mp4,
    write_wav,
)
from omni_diffusion_rl.prompts import load_prompts
from omni_diffusion_rl.world.avqa_files import example_clips
from omni_diffusion_rl.world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE

from .helpers import ENV, REPO

TINY = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1)
AT_16 = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (16, 16))


def _solid_mp4(path: Path, side: int, frames: int, fps: float = FPS, pts_step: int | None = None) -> Path:
    """`frames` frames of one colour each, `side` x `side`, as H.264 in an MP4, encoded one frame at
    a time (a 4096 x 4096 clip never held whole). pts_step: frame times in units of 1/100000 s (all
    in a few milliseconds: a frame-count bomb) instead of 1 / fps apart."""
    import av

    with av.open(str(path), mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=round(fps))
        stream.width = stream.height = side
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": "30", "preset": "ultrafast"}
        if pts_step is not None:
            stream.time_base = Fraction(1, 100_000)
        for index in range(frames):
            image = np.full((side, side, 3), (40 * index) % 256, dtype=np.uint8)
            frame = av.VideoFrame.from_ndarray(image, format="rgb24")
            if pts_step is not None:
                frame.pts, frame.time_base = index * pts_step, Fraction(1, 100_000)
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    return path


def _small_mp4(path: Path, height: int, width: int) -> tuple[Path, torch.Tensor]:
    """A lossless clip of the tiny format at height x width, and the frames written."""
    gen = torch.Generator().manual_seed(0)
    frames = torch.rand((int(FPS * DURATION_S), 3, height, width), generator=gen)
    write_mp4(path, frames, FPS)
    return path, decode_video(path, TINY)


@pytest.mark.parametrize(("height", "width"), [(8, 12), (64, 48)], ids=["enlarged", "shrunk"])
def test_frames_decoded_to_a_size_are_what_the_models_resize_made(
    tmp_path: Path, height: int, width: int
) -> None:
    """Enlarged frames equal the models' resize of the decoded clip bit for bit (the same float
    arithmetic, a frame at a time); shrunk ones are resized as bytes: within one level in 255."""
    path, whole = _small_mp4(tmp_path / "clip.mp4", height, width)
    resized = torch.nn.functional.interpolate(whole, (16, 16), mode="bilinear", antialias=True)
    at_size = decode_video(path, AT_16)
    assert at_size.shape == (4, 3, 16, 16) and at_size.dtype == torch.float32
    if height < 16:
        assert torch.equal(at_size, resized)
    else:
        assert 0 < (at_size - resized).abs().max() <= 1 / 255


def test_a_frame_count_bomb_is_refused_after_a_handful_of_frames(tmp_path: Path) -> None:
    """200 frames in the clip's first 2 ms: refused at the first frame past MAX_SOURCE_FPS's rate
    (with a burst of FRAME_BURST), the count in the sentence, not after decoding all 200."""
    bomb = _solid_mp4(tmp_path / "bomb.mp4", 64, 200, pts_step=1)
    with pytest.raises(
        ClipFileError, match=r"holds 9 frames in its first [0-9.e-]+ s, more than 240 a second"
    ):
        decode_video(bomb, AT_16)


def test_a_refused_file_is_refused_again_without_decoding_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Four lines naming the bomb: one decode, four skipped lines with its reason; rewritten as a
    good clip, the same path decodes again."""
    decoded: list[str] = []
    real = clip_files._decode_video  # noqa: SLF001 - counted, then called as it is

    def counted(path: str, clip: ClipFormat, convert: bool = True) -> torch.Tensor:
        decoded.append(path)
        return real(path, clip, convert)

    monkeypatch.setattr(clip_files, "_decode_video", counted)
    _solid_mp4(tmp_path / "clip.mp4", 64, 200, pts_step=1)
    good = example_clips(1, 0)[0]
    write_wav(tmp_path / "ok.wav", good.wave, SAMPLE_RATE)
    lines = [{"video": "clip.mp4", "question": f"how many {i}", "answer": "one"} for i in range(4)]
    lines.append({"audio": "ok.wav", "question": "which tone", "answer": "low"})
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert len(load_prompts(str(questions), "train", TINY, sound_from_video=False)) == 1
    assert len(decoded) == 1, decoded
    with pytest.raises(ClipFileError, match="more than 240 a second"):
        decode_video(tmp_path / "clip.mp4", AT_16)  # at another size too: the file is refused
    assert len(decoded) == 1
    write_mp4(tmp_path / "clip.mp4", good.video, FPS)
    assert len(load_prompts(str(questions), "train", TINY, sound_from_video=False)) == 5 and len(decoded) == 2


def test_a_clip_past_the_decode_time_bound_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = _small_mp4(tmp_path / "clip.mp4", 16, 16)
    (tmp_path / "copy.mp4").write_bytes(path.read_bytes())  # a file not decoded (cached) yet
    monkeypatch.setattr(clip_files, "MAX_DECODE_S", -1.0)  # the deadline already past: no clock decides
    with pytest.raises(ClipFileError, match=r"took over -1 s to decode \(1 frames\)"):
        decode_video(tmp_path / "copy.mp4", TINY)


_PEAK = """
import json, sys
from omni_diffusion_rl.answer_data.clip_files import ClipFormat
from omni_diffusion_rl.answer_data.questions import FileQuestion
from omni_diffusion_rl.prompts import load_prompts
from omni_diffusion_rl.world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE
clip = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1)
keys = load_prompts(sys.argv[1], "train", clip, sound_from_video=False)  # a silent MP4: its frames alone
asked = [FileQuestion.from_key(k).asked(ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (16, 16))) for k in keys]
status = dict(line.split(":", 1) for line in open("/proc/self/status") if ":" in line)
print(json.dumps({"lines": len(keys), "shape": list(asked[0].video.shape),
                  "peak_mb": int(status["VmHWM"].split()[0]) / 1024}))
"""  # VmHWM: this program's peak (getrusage's ru_maxrss keeps the forked parent's across exec)


@pytest.mark.slow  # two processes, so that each peak is its line's alone
def test_a_4096_square_clips_line_costs_at_most_twice_a_small_clips(tmp_path: Path) -> None:
    """A line naming four 4096 x 4096 frames (48 MiB each as bytes) is loaded and asked at the tiny
    model's 16 x 16 in a process whose peak resident memory is at most twice that of a process doing
    the same with a 16 x 16 clip (before: every frame held whole, then a float copy, about 1 GiB)."""
    peaks = {}
    for side in (16, 4096):
        folder = tmp_path / str(side)
        folder.mkdir()
        _solid_mp4(folder / "clip.mp4", side, int(FPS * DURATION_S))
        line = {"video": "clip.mp4", "question": "which colour", "answer": "grey"}
        (folder / "q.jsonl").write_text(json.dumps(line) + "\n")
        done = subprocess.run(
            [sys.executable, "-c", _PEAK, str(folder / "q.jsonl")],
            capture_output=True,
            text=True,
            env={**ENV, "OMP_NUM_THREADS": "1"},
            cwd=REPO,
            timeout=300,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        report = json.loads(done.stdout.strip().splitlines()[-1])
        assert report["lines"] == 1 and report["shape"] == [4, 3, 16, 16], report
        peaks[side] = report["peak_mb"]
    assert peaks[4096] <= 2 * peaks[16], peaks
