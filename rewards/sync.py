"""Rewards for synchrony and counts of any clip with sound (sync_metrics.py's events), for the
tiny sync world and for real generators alike: they read decoded video and audio at any size, frame
rate and sample rate.

- `sync_onsets`: AV-Align's IoU made soft: audio onsets and motion events paired one to one, closest
  first, a pair counting 1 - gap / SOFT_REACH (1 together, 0.75 a frame apart, 0 at four frames);
  credits / (audio events + visual events - pairs). No events at all scores 0, a sound at every
  frame scores about one over their number, the right events a frame or two apart part of 1.
- `strike_count`: how well each modality's event count matches the prompt's ("once", "twice",
  "three times", "N times", summed over its clauses): 1 / (1 + |count - asked|), averaged over
  audio and video. A prompt that asks for no count is an error.

Neither is the tiny sync world's judge (world/sync_judge.py), which finds objects by colour and
sounds by pitch: they are what a training run optimises, the judge what an evaluation trusts.
What they cannot see: two strikes closer than two frames are one event, and a cut or a flash is a
visual event (docs/sync.md). Option `motion_columns` (both; default 1, the whole picture): read the
picture's motion in that many vertical strips, so that objects side by side are counted apart (the
tiny sync recipe reads 4); an object gliding sideways then makes an event at each strip it enters.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits
from omni_diffusion_rl.sync_metrics import DEFAULT_SYNC, SyncReport, SyncSettings, sync_report

SOFT_REACH = 4.0  # frames: a pair this far apart earns nothing
SYNC_CLIP_LIMITS = InputLimits(  # a generator's clip: LTX-2's 121 frames, H3's 124, with room
    frames=256,
    frame_height=1080,
    frame_width=1920,
    audio_samples=2 * 48_000 * 20,
    meant_for="generated clips with sound: up to 256 frames of 1920 x 1080, 20 s of stereo 48 kHz",
)
COUNT_WORDS = {"once": 1, "one time": 1, "twice": 2, "two times": 2, "thrice": 3, "three times": 3}
COUNT_WORDS |= {f"{n} times": n for n in range(1, 21)}
_COUNT = re.compile(r"\b(" + "|".join(sorted(map(re.escape, COUNT_WORDS), key=len, reverse=True)) + r")\b")


def _reports(media: MediaBatch, settings: SyncSettings) -> list[SyncReport]:
    if media.video is None or media.audio is None:
        raise ValueError("the sync rewards need video and audio; the media batch lacks one")
    return [
        sync_report(v, media.fps, a, media.sample_rate, settings)
        for v, a in zip(media.video, media.audio, strict=True)
    ]


def _settings(motion_columns: int) -> SyncSettings:
    if (
        isinstance(motion_columns, bool)
        or not isinstance(motion_columns, int)
        or not 1 <= motion_columns <= 64
    ):
        raise ValueError(
            f"motion_columns must be a whole number from 1 (the whole picture, AV-Align's reading) to 64; "
            f"got {motion_columns!r}"
        )
    return dataclasses.replace(DEFAULT_SYNC, motion_columns=motion_columns)


def soft_iou(report: SyncReport, fps: float) -> float:
    """AV-Align's IoU with each pair's credit falling linearly with its gap, from 1 (together) to 0 at
    SOFT_REACH frames. Not flat within AV-Align's one-frame window: a policy whose sound sits a frame
    late would find nothing to gain there (seen: NFT parked the sound 1.01 frames off its strikes)."""
    pairs = sorted(
        (abs(a - v) * fps, i, j)
        for i, a in enumerate(report.audio_events_s)
        for j, v in enumerate(report.visual_events_s)
    )
    used_a: set[int] = set()
    used_v: set[int] = set()
    credit = 0.0
    for gap, i, j in pairs:
        if gap >= SOFT_REACH or i in used_a or j in used_v:
            continue
        used_a.add(i)
        used_v.add(j)
        credit += 1.0 - gap / SOFT_REACH
    union = report.audio_count + report.visual_count - len(used_a)
    return credit / union if union else 0.0


def asked_count(prompt: str) -> int:
    """The events a prompt asks for: its count phrases summed (one per object)."""
    found = _COUNT.findall(prompt.lower())
    if not found:
        raise ValueError(
            f"strike_count: the prompt {prompt[:120]!r} asks for no count (once, twice, three times, "
            "N times): name one, or leave strike_count out of reward.weights"
        )
    return sum(COUNT_WORDS[f] for f in found)


@rewards.register("sync_onsets")
class SyncOnsetsReward:
    """Sound onsets on motion events: AV-Align's IoU, soft beyond one frame; [B] in [0, 1]."""

    input_limits = SYNC_CLIP_LIMITS

    def __init__(self, motion_columns: int = 1) -> None:
        self.settings = _settings(motion_columns)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        return torch.tensor([soft_iou(r, media.fps) for r in _reports(media, self.settings)])


@rewards.register("strike_count")
class StrikeCountReward:
    """Each modality's event count against the prompt's: [B] in (0, 1]."""

    input_limits = SYNC_CLIP_LIMITS

    def __init__(self, motion_columns: int = 1) -> None:
        self.settings = _settings(motion_columns)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        asked = [asked_count(p) for p in prompts]
        scores = [
            0.5 / (1 + abs(r.audio_count - n)) + 0.5 / (1 + abs(r.visual_count - n))
            for r, n in zip(_reports(media, self.settings), asked, strict=True)
        ]
        return torch.tensor(scores)
