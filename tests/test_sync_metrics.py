"""Synchrony metrics (sync_metrics.py) on constructed clips: the tiny sync world's own, the same
with the sound shifted by k frames, a clip of another format built here without the world's code,
and the clips a reward-gaming generator would make."""

from __future__ import annotations

import collections
import math
import random

import pytest
import torch

from omni_diffusion_rl.sync_metrics import SyncSettings, sound_sources, sync_report, turning
from omni_diffusion_rl.world import tiny_sync as world

from .helpers import lopsided_bounce, shifted_wave

HALF_POINT = 0.5 / SyncSettings().hops_per_frame  # the offset's resolution, in frames


def _scenes(count: int, seed: int) -> list[world.SyncScene]:
    rng = random.Random(seed)
    return [world.random_scene(rng) for _ in range(count)]


def test_the_worlds_clips_are_in_sync_and_counted() -> None:
    """Every strike of a world clip is one audio and one visual event on the strike's frame: counts
    exact, AV-Align's IoU 1, the envelopes' offset 0 (to half an envelope point)."""
    for scene in _scenes(60, seed=0):
        frames, wave = world.clip_tensors(scene)
        report = sync_report(frames, world.FPS, wave, world.SAMPLE_RATE)
        strikes = [s / world.FPS for s in scene.objects[0].strikes]
        assert report.audio_count == report.visual_count == len(strikes), scene
        assert report.iou == 1.0 and report.matched == len(strikes)
        for found in (report.audio_events_s, report.visual_events_s):
            assert max(abs(a - b) for a, b in zip(found, strikes, strict=True)) * world.FPS < 0.01
        assert abs(report.offset_ms) <= HALF_POINT * 1000 / world.FPS


@pytest.mark.parametrize("k", [-3, -2, -1, 1, 2, 3])
def test_sound_shifted_by_k_frames_reads_an_offset_of_k_frames(k: int) -> None:
    """The world's clips with their sound delayed (k > 0) or advanced by k frames: the offset reads k
    frames (to half an envelope point) and the counts stay; beyond the one-frame window they are no
    longer all matched."""
    for scene in _scenes(20, seed=k + 10):
        frames, wave = world.clip_tensors(scene)
        strikes = scene.objects[0].strikes
        report = sync_report(
            frames, world.FPS, shifted_wave(wave, k * world.SAMPLE_RATE // 16), world.SAMPLE_RATE
        )
        heard = [s for s in strikes if 0 < s + k < world.FRAMES]  # a strike shifted out of the clip is gone
        assert report.audio_count == len(heard) and report.visual_count == len(strikes)
        if len(heard) == len(strikes):  # (one sound left between two strikes could be either's)
            assert report.offset_ms * world.FPS / 1000 == pytest.approx(k, abs=HALF_POINT), scene
        if heard and abs(k) >= 2:  # (a strike may still fall within a frame of another one)
            assert report.iou < 1.0


def _bouncing_disc_clip(strikes_s: list[float], fps: float, size: tuple[int, int], sample_rate: int):
    """A clip of another format, made here: a disc dropped, bouncing off the floor at `strikes_s`
    (equally spaced, so every bounce is as fast on both sides) and caught at the top of the last
    bounce, each strike a burst of decaying noise, in stereo."""
    duration, apex_px, radius = 1.5, 14.0, 8.0
    height, width = size
    gap = strikes_s[1] - strikes_s[0]
    times = torch.arange(round(duration * fps), dtype=torch.float64) / fps
    held = times.clamp(strikes_s[0] - gap / 2, strikes_s[-1] + gap / 2)
    since = torch.remainder(held - strikes_s[0], gap)
    lift = apex_px * 4 * since * (gap - since) / gap**2
    rows = torch.arange(height, dtype=torch.float64)[:, None]
    cols = torch.arange(width, dtype=torch.float64)[None]
    frames = torch.zeros(len(times), 3, height, width)
    for i, up in enumerate(lift.tolist()):
        distance = ((rows - (height - radius - up)) ** 2 + (cols - width / 3) ** 2).sqrt()
        disc = (radius + 0.5 - distance).clamp(0, 1).float()
        frames[i] = torch.stack([disc, 0.6 * disc, 0.2 * disc])
    generator = torch.Generator().manual_seed(0)
    samples = round(duration * sample_rate)
    t = torch.arange(samples, dtype=torch.float64) / sample_rate
    wave = torch.zeros(2, samples)
    for s in strikes_s:
        burst = torch.where(t >= s, torch.exp(-(t - s) / 0.03), torch.zeros_like(t)).float()
        wave += 0.3 * burst * torch.randn(2, samples, generator=generator)
    return frames, wave


def test_a_clip_of_another_format_made_without_the_world_reads_its_strikes() -> None:
    """24 fps, 40 x 60 frames, stereo 44.1 kHz noise bursts: the metrics need no world, no size and
    no rate of their own."""
    strikes = [0.25, 0.625, 1.0]
    frames, wave = _bouncing_disc_clip(strikes, 24.0, (40, 60), 44_100)
    report = sync_report(frames, 24.0, wave, 44_100)
    assert report.audio_count == report.visual_count == 3
    assert report.iou == 1.0
    assert max(abs(a - b) for a, b in zip(report.visual_events_s, strikes, strict=True)) < 0.5 / 24
    assert abs(report.offset_ms) < 1000 / 24 / 2
    late = sync_report(frames, 24.0, shifted_wave(wave, 4410 // 2), 44_100)  # 50 ms: 1.2 frames
    assert late.offset_ms == pytest.approx(50, abs=1000 / 24 / 4)


def _moving_square(frames: int, speed: float) -> torch.Tensor:
    """A square gliding right at a constant speed: motion, but no strike."""
    video = torch.full((frames, 3, world.SIZE, world.SIZE), world.BACKGROUND)
    for i in range(frames):
        left = 1 + speed * i
        cover = (
            torch.minimum(torch.arange(world.SIZE) + 1.0, torch.tensor(left + 3))
            - torch.clamp(torch.arange(world.SIZE).float(), min=left)
        ).clamp(0, 1)
        video[i, 0] = video[i, 0] * (1 - cover[None]) + 0.9 * cover[None]
    return video


def test_reward_gaming_clips_score_nothing_in_sync() -> None:
    """A constant glide with a constant tone, and a real strike drowned in a click at every frame:
    no or few events in sync (IoU 0, or far below a world clip's 1)."""
    envelope = torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS)
    envelope[0, :, 5] = 1.0
    tone = world.render_audio(envelope)[0]
    glide = sync_report(_moving_square(world.FRAMES, 0.6), world.FPS, tone, world.SAMPLE_RATE)
    assert glide.audio_count == 0 and glide.visual_count == 0 and glide.iou == 0.0
    assert math.isnan(glide.offset_ms)
    scene = _scenes(1, seed=3)[0]
    frames, _ = world.clip_tensors(scene)
    clicks = torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS)
    for frame in range(world.FRAMES):
        clicks[0, frame * world.HOPS_PER_FRAME, 3] = 1.0
    every_frame = sync_report(frames, world.FPS, world.render_audio(clicks)[0], world.SAMPLE_RATE)
    assert every_frame.audio_count >= world.FRAMES // 2 - 1
    assert every_frame.iou <= len(scene.objects[0].strikes) / every_frame.audio_count


def test_strips_count_two_objects_side_by_side_that_the_whole_picture_merges() -> None:
    """Two objects bouncing side by side (their strikes 2 frames apart or more): read in 4 strips,
    every strike of both is one visual event, in sync with its sound; the whole picture's motion
    (AV-Align's reading) loses some in the other object's motion. A glide across the strips is the
    strips' cost: an event where it enters each."""
    strips = SyncSettings(motion_columns=4)
    rng = random.Random(4)
    whole_right = 0
    for _ in range(40):
        scene = world.random_scene(rng, second_object=1.0)
        strikes = sorted(s / world.FPS for o in scene.objects for s in o.strikes)
        frames, wave = world.clip_tensors(scene)
        report = sync_report(frames, world.FPS, wave, world.SAMPLE_RATE, strips)
        assert report.visual_count == report.audio_count == len(strikes), scene
        assert report.iou == 1.0
        assert (
            max(abs(a - b) for a, b in zip(report.visual_events_s, strikes, strict=True)) * world.FPS < 0.26
        )
        whole_right += sync_report(frames, world.FPS, wave, world.SAMPLE_RATE).visual_count == len(strikes)
    assert whole_right <= 20
    tone = world.render_audio(torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS))[0]
    glide = sync_report(_moving_square(world.FRAMES, 0.6), world.FPS, tone, world.SAMPLE_RATE, strips)
    assert glide.visual_count >= 2


def test_each_onset_reads_the_pitch_it_brings_and_sources_group_by_pitch() -> None:
    """Plucked tones over a faint hiss, made here (44.1 kHz, 24 fps): 330 Hz at 0.2 s and 0.9 s,
    495 Hz at 0.5 s while the first still rings: each onset reads its own tone's pitch (not the one
    ringing on), the two 330 Hz onsets are one source and the 495 Hz one another; the world's pairs
    are two sources whose strikes are the objects' counts, and each visual event's strip is its
    object's."""
    rate, fps = 44_100, 24.0
    t = torch.arange(round(1.2 * rate), dtype=torch.float64) / rate
    wave = 0.01 * torch.randn(len(t), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for start, hz in ((0.2, 330.0), (0.5, 495.0), (0.9, 330.0)):
        wave += torch.where(t >= start, torch.exp(-(t - start) / 0.12), 0) * torch.sin(2 * math.pi * hz * t)
    frames = torch.zeros(round(1.2 * fps), 3, 8, 8)
    report = sync_report(frames, fps, wave.float(), rate)
    assert report.audio_events_s == pytest.approx((0.2, 0.5, 0.9), abs=0.5 / fps)
    assert report.audio_event_hz == pytest.approx((330, 495, 330), rel=0.01)
    assert sound_sources(list(report.audio_event_hz)) == [0, 1, 0]
    assert sound_sources([100.0, 110.0, 121.0, math.nan, 200.0]) == [0, 0, 0, 2, 1]  # a chain; no pitch

    rng = random.Random(5)
    for _ in range(12):
        scene = world.random_scene(rng, second_object=1.0)
        frames, wave = world.clip_tensors(scene)
        report = sync_report(frames, world.FPS, wave, world.SAMPLE_RATE, SyncSettings(motion_columns=4))
        heard = collections.Counter(sound_sources(list(report.audio_event_hz)))
        seen = collections.Counter(strip // 2 for strip in report.visual_event_strips)
        counts = sorted(o.count for o in scene.objects)
        assert sorted(heard.values()) == counts and [seen[0], seen[1]] == [o.count for o in scene.objects]


def test_motion_at_frames_puts_a_lopsided_bounce_on_its_contact_frame() -> None:
    """Motion between frames peaks off the contact of a bounce faster on one side than the other
    (here 0.58 frames early: a sound a frame early would be the closer); read at frames, the
    event is the contact frame, where the motion turns back. The world's clips, whose bounces are
    even, read the same events either way."""
    fps = 24.0
    for contact in (10, 15, 21):
        frames, wave = lopsided_bounce(contact, fps)
        between = sync_report(frames, fps, wave, 44_100)
        at_frames = sync_report(frames, fps, wave, 44_100, SyncSettings(motion_at="frames"))
        assert between.visual_count == at_frames.visual_count == 1
        assert contact - between.visual_events_s[0] * fps >= 0.5
        assert at_frames.visual_events_s[0] * fps == pytest.approx(contact)
        assert at_frames.audio_events_s == between.audio_events_s
    turned = turning(frames, 1)[0]
    assert int(turned.argmax()) == 21 and float(turned[12]) < 0.05 * float(turned[21])  # falling: no turn
    for scene in _scenes(20, seed=6):
        frames, wave = world.clip_tensors(scene)
        reads = [
            sync_report(
                frames, world.FPS, wave, world.SAMPLE_RATE, SyncSettings(motion_columns=4, motion_at=at)
            )
            for at in ("between_frames", "frames")
        ]
        assert reads[0].visual_events_s == pytest.approx(reads[1].visual_events_s, abs=1e-6)


def test_bad_settings_and_shapes_are_refused_with_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="hops_per_frame"):
        SyncSettings(hops_per_frame=0)
    with pytest.raises(ValueError, match="motion_columns"):
        SyncSettings(motion_columns=0)
    with pytest.raises(ValueError, match="relative_threshold"):
        SyncSettings(relative_threshold=1.5)
    with pytest.raises(ValueError, match="motion_at must be one of between_frames, frames"):
        SyncSettings(motion_at="frame")
    frames, wave = world.clip_tensors(_scenes(1, seed=0)[0])
    with pytest.raises(ValueError, match=r"\[T >= 2, C, H, W\]"):
        sync_report(frames[:1], world.FPS, wave, world.SAMPLE_RATE)
    with pytest.raises(ValueError, match="positive"):
        sync_report(frames, 0.0, wave, world.SAMPLE_RATE)
    with pytest.raises(ValueError, match="waveform"):
        sync_report(frames, world.FPS, wave[None], world.SAMPLE_RATE)
