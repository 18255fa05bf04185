"""Clips with sound on disk: MP4s a browser plays (media.save_mp4: H.264 and AAC), read back through
PyAV with their sound track in time, and `odrl eval --clips FOLDER` reading the offsets they were
written with."""

from __future__ import annotations

import json
import random
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from PIL import Image

from omni_diffusion_rl.answer_data.clip_files import (
    ClipFileError,
    ClipFormat,
    decode_sound_track,
    file_timing,
)
from omni_diffusion_rl.media import save_gif, save_mp4
from omni_diffusion_rl.world import tiny_sync as world

from .helpers import odrl_main, shifted_wave

FRAME_SAMPLES = world.SAMPLE_RATE // int(world.FPS)


def _scene(seed: int) -> world.SyncScene:
    """A world scene whose strikes stay in the clip when its sound is moved by up to 3 frames."""
    rng = random.Random(seed)
    while True:
        scene = world.random_scene(rng)
        if all(3 < s < world.FRAMES - 4 for s in scene.objects[0].strikes):
            return scene


def test_an_mp4_with_sound_plays_in_a_browser_and_its_sound_comes_back_in_time(tmp_path: Path) -> None:
    """H.264 in yuv420p at even sides and AAC at 48 kHz; the sound read back (at the world's 8 kHz)
    lines up with what was written to the sample (the encoder's priming is marked and skipped)."""
    frames, wave = world.clip_tensors(_scene(0))
    path = Path(save_mp4(tmp_path / "clip.mp4", frames, world.FPS, wave, world.SAMPLE_RATE, scale=5))
    with av.open(str(path)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        assert (video.codec_context.name, video.codec_context.pix_fmt) == ("h264", "yuv420p")
        assert (video.width, video.height) == (80, 80) and audio.codec_context.name == "aac"
        assert audio.rate == 48_000
    timing = file_timing(path)
    assert (timing.fps, timing.sample_rate, timing.height) == (world.FPS, 48_000, 80)
    clip = ClipFormat(fps=world.FPS, sample_rate=world.SAMPLE_RATE, seconds=1.0)
    back = decode_sound_track(path, clip)[0].numpy()
    sent = wave[0].numpy()
    lags = range(-200, 201)
    best = max(lags, key=lambda lag: float(np.dot(np.roll(back, -lag)[400:-400], sent[400:-400])))
    assert best == 0
    assert np.corrcoef(back, sent)[0, 1] > 0.9  # AAC is lossy, not a different sound


def test_a_video_without_sound_and_a_broken_file_say_why(tmp_path: Path) -> None:
    frames, _ = world.clip_tensors(_scene(1))
    silent = Path(save_mp4(tmp_path / "silent.mp4", frames, world.FPS))
    clip = ClipFormat(fps=world.FPS, sample_rate=world.SAMPLE_RATE, seconds=1.0)
    with pytest.raises(ClipFileError, match="has no sound track"):
        decode_sound_track(silent, clip)
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"not a video")
    with pytest.raises(ClipFileError, match="cannot be opened as video"):
        file_timing(broken)


def test_eval_clips_reads_the_offsets_the_clips_were_written_with(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """World clips written as MP4s with their sound moved by k frames (late when k > 0), a clip
    without sound and a broken file: `odrl eval --clips` reads each offset as k frames (within a
    quarter frame through H.264 and AAC), counts every strike, and reports the two it cannot read
    with the reason."""
    shifts = {"early_2.mp4": -2, "in_sync.mp4": 0, "late_1.mp4": 1, "late_3.mp4": 3}
    strikes = {}
    for i, (name, k) in enumerate(shifts.items()):
        scene = _scene(10 + i)
        frames, wave = world.clip_tensors(scene)
        save_mp4(tmp_path / name, frames, world.FPS, shifted_wave(wave, k * FRAME_SAMPLES), world.SAMPLE_RATE)
        strikes[name] = len(scene.objects[0].strikes)
    save_mp4(tmp_path / "silent.mp4", world.clip_tensors(_scene(20))[0], world.FPS)
    (tmp_path / "broken.mp4").write_bytes(b"not a video")
    (tmp_path / "notes.txt").write_text("not a clip")
    output = tmp_path / "out" / "sync.json"
    code, printed, err = odrl_main(capsys, "eval", "--clips", str(tmp_path), "--output", str(output))
    assert code == 0, err
    result = json.loads(printed.strip().splitlines()[-1])
    assert json.loads(output.read_text()) == result
    clips = result["clips"]
    assert set(clips) == {*shifts, "silent.mp4", "broken.mp4"}
    assert "no sound track" in clips["silent.mp4"]["error"]
    assert "cannot be opened as video" in clips["broken.mp4"]["error"]
    for name, k in shifts.items():
        assert clips[name]["offset_ms"] * world.FPS / 1000 == pytest.approx(k, abs=0.25), name
        assert clips[name]["audio_count"] == clips[name]["visual_count"] == strikes[name], name
        if k == 0 or abs(k) >= 2:  # (one frame is AV-Align's window: its edge, either way)
            assert (clips[name]["iou"] == 1.0) == (k == 0), name
    assert result["summary"]["read"] == 4 and result["summary"]["failed"] == 2


def test_eval_clips_refuses_targets_beside_it_and_an_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = odrl_main(capsys, "eval", "world", "--clips", str(tmp_path))
    assert code != 0 and "name no targets beside it" in err
    code, _, err = odrl_main(capsys, "eval", "--clips", str(tmp_path))
    assert code != 0 and "no video files" in err


def test_a_preview_mp4_enlarges_small_frames_only(tmp_path: Path) -> None:
    """By default a 16-pixel frame is enlarged 8 times; a real model's frame keeps its size (a
    frame of 768 x 1344 enlarged 8 times would be larger than H.264 allows)."""
    small = Path(save_mp4(tmp_path / "small.mp4", torch.rand(2, 3, 16, 16), 8.0))
    large = Path(save_mp4(tmp_path / "large.mp4", torch.rand(2, 3, 301, 500), 8.0))
    for path, size in ((small, (128, 128)), (large, (302, 500))):  # padded to even sides
        with av.open(str(path)) as container:
            stream = container.streams.video[0]
            assert (stream.height, stream.width) == size
    gif = save_gif(tmp_path / "large.gif", torch.rand(2, 3, 301, 500), 8.0)  # the same rule for GIFs
    with Image.open(gif) as picture:
        assert picture.size == (500, 301)
