"""Rewards for synchrony and counts of any clip with sound (sync_metrics.py's events), for the
tiny sync world and for real generators alike: they read decoded video and audio at any size, frame
rate and sample rate.

- `sync_onsets`: AV-Align's IoU made soft: audio onsets and motion events paired one to one, closest
  first, a pair counting 1 - gap / SOFT_REACH (1 together, 0.75 a frame apart, 0 at four frames);
  credits / (audio events + visual events - pairs). No events at all scores 0, a sound at every
  frame scores about one over their number, the right events a frame or two apart part of 1.
  Option `reach_frames` (default 4): where a pair's credit reaches 0. Option `per_source` (default
  false): each sound source (by pitch) scored against one region of the picture, as strike_count's
  (the prompt's count phrases say how many objects): a sound on another object's strike earns
  nothing (seen: NFT paid 0.69 for pairs whose sounds the judge found on their own object's
  strikes 8% of the time). Option `motion_at` (default "between_frames", AV-Align's reading):
  "frames" moves each visual event onto the whole frame the motion turns at, where a strike happens
  (sync_metrics' `on_whole_frames`).
- `strike_count`: how well each modality's event count matches the prompt's ("once", "twice",
  "three times", "N times", summed over its clauses): 1 / (1 + |count - asked|), averaged over
  audio and video. A prompt that asks for no count is an error. Option `per_source` (default
  false): count each object apart, whichever is which: the sounds grouped by pitch (sync_metrics'
  `sound_sources`) and the picture split into one region an object, left to right, each list of
  counts matched against the prompt's (sorted, `counts_match`). Summed counts cannot tell one object
  striking three times from two striking once and twice (seen: NFT on the sync world got the sums
  right and the objects wrong); per source needs objects that differ in pitch and stand side by side.
- `strike_diversity`: how far apart in time a sample's strikes are from those of the other samples
  of its prompt in the batch (prompts never say when): a policy giving every sample the same bounce
  scores 0.

Neither is the tiny sync world's judge (world/sync_judge.py), which finds objects by colour and
sounds by pitch: they are what a training run optimises, the judge what an evaluation trusts.
What they cannot see: two strikes closer than two frames are one event, and a cut or a flash is a
visual event (docs/sync.md). Option `motion_columns` (both; default 1, the whole picture): read the
picture's motion in that many vertical strips, so that objects side by side are counted apart (the
tiny sync recipe reads 4); an object gliding sideways then makes an event at each strip it enters.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

import torch

from omni_diffusion_rl.algorithms.credit import JUDGES
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits, samples_by_prompt
from omni_diffusion_rl.sync_metrics import (
    DEFAULT_SYNC,
    SyncReport,
    SyncSettings,
    one_to_one,
    sound_sources,
    sync_report,
)

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


def _settings(motion_columns: int, motion_at: str = DEFAULT_SYNC.motion_at) -> SyncSettings:
    if (
        isinstance(motion_columns, bool)
        or not isinstance(motion_columns, int)
        or not 1 <= motion_columns <= 64
    ):
        raise ValueError(
            f"motion_columns must be a whole number from 1 (the whole picture, AV-Align's reading) to 64; "
            f"got {motion_columns!r}"
        )
    return dataclasses.replace(DEFAULT_SYNC, motion_columns=motion_columns, motion_at=motion_at)


def soft_iou(report: SyncReport, fps: float, reach: float = SOFT_REACH) -> float:
    """AV-Align's IoU with each pair's credit falling linearly with its gap, from 1 (together) to 0 at
    `reach` frames. Not flat within AV-Align's one-frame window: a policy whose sound sits a frame
    late would find nothing to gain there (seen: NFT parked the sound 1.01 frames off its strikes)."""
    return soft_event_iou(list(report.audio_events_s), list(report.visual_events_s), fps, reach)


def soft_event_iou(audio_s: list[float], visual_s: list[float], fps: float, reach: float) -> float:
    """`soft_iou` of two lists of event times (s)."""
    gaps = sorted((abs(a - v) * fps, i, j) for i, a in enumerate(audio_s) for j, v in enumerate(visual_s))
    pairs = one_to_one((gap, i, j) for gap, i, j in gaps if gap < reach)
    union = len(audio_s) + len(visual_s) - len(pairs)
    return sum(1.0 - gap / reach for gap, _, _ in pairs) / union if union else 0.0


def soft_iou_per_source(report: SyncReport, fps: float, reach: float, objects: int, strips: int) -> float:
    """`soft_iou` of each sound source (grouped by pitch) against one region of the picture (the
    strips split into `objects` regions, left to right), sources and regions paired one to one, the
    best-scoring pair first (bounded work whatever a clip's number of sources), summed over the pairs
    and divided by the larger of the two numbers: a sound on another object's strike earns nothing,
    and a source or region left over counts 0."""
    sources = sound_sources(list(report.audio_event_hz))
    heard: dict[int, list[float]] = {}
    for source, at in zip(sources, report.audio_events_s, strict=True):
        heard.setdefault(source, []).append(at)
    seen: list[list[float]] = [[] for _ in range(objects)]
    for strip, at in zip(report.visual_event_strips, report.visual_events_s, strict=True):
        seen[strip * objects // strips].append(at)
    regions = [r for r in seen if r]
    scores = (
        (soft_event_iou(h, r, fps, reach), i, j)
        for i, h in enumerate(heard.values())
        for j, r in enumerate(regions)
    )
    return sum(score for score, _, _ in one_to_one(sorted(scores, reverse=True))) / max(len(heard), objects)


def _check_regions(reward: str, objects: int, strips: int) -> None:
    if objects > strips:
        raise ValueError(
            f"{reward} per_source reads one region of the picture an object: a prompt names {objects} "
            f"objects and motion_columns reads {strips} strips; set motion_columns to {objects} or more"
        )


def asked_counts(prompt: str) -> list[int]:
    """The events a prompt asks of each object: its count phrases, in order (one per object)."""
    found = _COUNT.findall(prompt.lower())
    if not found:
        raise ValueError(
            f"strike_count: the prompt {prompt[:120]!r} asks for no count (once, twice, three times, "
            "N times): name one, or leave strike_count out of reward.weights"
        )
    return [COUNT_WORDS[f] for f in found]


def counts_match(asked: list[int], found: list[int]) -> float:
    """How well counts found per source match the counts asked per object, whichever source is which:
    both sorted, the shorter padded with zeros, 1 / (1 + |difference|) averaged over the places."""
    places = max(len(asked), len(found))
    asked_sorted = sorted(asked, reverse=True) + [0] * (places - len(asked))
    found_sorted = sorted(found, reverse=True) + [0] * (places - len(found))
    return sum(1 / (1 + abs(a - f)) for a, f in zip(asked_sorted, found_sorted, strict=True)) / places


def source_counts(report: SyncReport, objects: int, strips: int) -> tuple[list[int], list[int]]:
    """Events per sound source (`sound_sources`: grouped by pitch) and per region of the picture
    (the strips split into `objects` equal regions, left to right)."""
    heard = Counter(sound_sources(list(report.audio_event_hz)))
    seen = Counter(strip * objects // strips for strip in report.visual_event_strips)
    return list(heard.values()), [seen[region] for region in range(objects)]


@rewards.register("sync_onsets")
class SyncOnsetsReward:
    """Sound onsets on motion events: AV-Align's IoU, soft beyond one frame; [B] in [0, 1]."""

    builds_in_a_blink = True  # nothing to load: --check builds it with its options
    input_limits = SYNC_CLIP_LIMITS
    modality = "audio_video"

    def __init__(
        self,
        motion_columns: int = 1,
        reach_frames: float = SOFT_REACH,
        motion_at: str = DEFAULT_SYNC.motion_at,
        per_source: bool = False,
    ) -> None:
        self.settings = _settings(motion_columns, motion_at)
        if not isinstance(per_source, bool):
            raise ValueError(f"per_source must be true or false; got {per_source!r}")
        self.per_source = per_source
        if (
            isinstance(reach_frames, bool)
            or not isinstance(reach_frames, int | float)
            or not 0 < reach_frames <= 16
        ):
            raise ValueError(
                "reach_frames (where a pair's credit reaches 0) is in frames, above 0 and at most 16; "
                f"got {reach_frames!r}"
            )
        self.reach = float(reach_frames)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        reports = _reports(media, self.settings)
        if not self.per_source:
            return torch.tensor([soft_iou(r, media.fps, self.reach) for r in reports])
        strips = min(self.settings.motion_columns, media.video.shape[-1])
        objects = [len(asked_counts(p)) for p in prompts]
        _check_regions("sync_onsets", max(objects), strips)
        return torch.tensor(
            [
                soft_iou_per_source(r, media.fps, self.reach, n, strips)
                for r, n in zip(reports, objects, strict=True)
            ]
        )


@rewards.register("strike_count")
class StrikeCountReward:
    """Each modality's event count against the prompt's, averaged: [B] in (0, 1]. `heard_count`
    and `seen_count` score one modality each (per-modality credit routes them apart)."""

    builds_in_a_blink = True  # nothing to load: --check builds it with its options
    input_limits = SYNC_CLIP_LIMITS
    modality = "audio_video"

    def __init__(self, motion_columns: int = 1, per_source: bool = False) -> None:
        self.settings = _settings(motion_columns)
        if not isinstance(per_source, bool):
            raise ValueError(f"per_source must be true or false; got {per_source!r}")
        self.per_source = per_source

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        asked = [asked_counts(p) for p in prompts]
        reports = _reports(media, self.settings)
        strips = min(self.settings.motion_columns, media.video.shape[-1])
        if self.per_source:
            _check_regions("strike_count", max(len(n) for n in asked), strips)
        scores = []
        for r, per_object in zip(reports, asked, strict=True):
            if self.per_source:
                wanted, (heard, seen) = per_object, source_counts(r, len(per_object), strips)
            else:  # the whole clip one source, asked the sum of the counts
                wanted, heard, seen = [sum(per_object)], [r.audio_count], [r.visual_count]
            by_modality = {"audio": counts_match(wanted, heard), "video": counts_match(wanted, seen)}
            judged = [by_modality[m] for m in JUDGES[self.modality]]
            scores.append(sum(judged) / len(judged))
        return torch.tensor(scores)


@rewards.register("heard_count")
class HeardCountReward(StrikeCountReward):
    """strike_count on the sound alone: the heard events' count against the prompt's."""

    modality = "audio"


@rewards.register("seen_count")
class SeenCountReward(StrikeCountReward):
    """strike_count on the picture alone: the seen events' count against the prompt's."""

    modality = "video"


def chamfer_frames(a: list[float], b: list[float]) -> float:
    """How far two sets of event times (frames) are apart: each event's distance to the nearest of
    the other set, averaged within each set, then over the two; 0 when both are empty, inf when one
    is."""
    if not a and not b:
        return 0.0
    if not a or not b:
        return math.inf
    near_a = sum(min(abs(x - y) for y in b) for x in a) / len(a)
    near_b = sum(min(abs(x - y) for x in a) for y in b) / len(b)
    return (near_a + near_b) / 2


@rewards.register("strike_diversity")
class StrikeDiversityReward:
    """When a sample's strikes happen, against the other samples of its prompt in the batch: the
    mean `chamfer_frames` distance of its visual events to theirs, in units of `spread` frames,
    capped at 1; [B] in [0, 1].

    Prompts say how many strikes, never when, and the world draws their frames at random; without
    this term NFT gave every sample of a prompt the same strikes (the judge's distinct_strikes 0.38 to
    0.45 where the world's own clips have 0.66; one prompt 0.06). A clip with no visual event scores
    0; a sample whose prompt has no other sample in the batch cannot be scored: NaN (a failed sample,
    never a 0). Score a prompt's samples in one call (a reward server's --max-batch a multiple of the
    group size)."""

    builds_in_a_blink = True  # nothing to load: --check builds it with its options
    input_limits = SYNC_CLIP_LIMITS
    modality = "video"

    def __init__(self, spread: float = 1.0, motion_columns: int = 1) -> None:
        if isinstance(spread, bool) or not isinstance(spread, int | float) or not 0 < spread <= 100:
            raise ValueError(f"spread is in frames, above 0 and at most 100; got {spread!r}")
        self.spread = float(spread)
        self.settings = _settings(motion_columns)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        events = [[t * media.fps for t in r.visual_events_s] for r in _reports(media, self.settings)]
        scores = [math.nan] * len(prompts)
        for members in samples_by_prompt(prompts):
            if len(members) < 2:
                continue  # nothing to compare with: NaN, so the sample counts as not scored
            for i in members:
                if not events[i]:
                    scores[i] = 0.0
                    continue
                apart = [min(chamfer_frames(events[i], events[j]), self.spread) for j in members if j != i]
                scores[i] = sum(apart) / len(apart) / self.spread
        return torch.tensor(scores)
