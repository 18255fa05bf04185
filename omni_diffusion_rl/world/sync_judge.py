"""The tiny sync world's judge: which of a prompt's facts a generated clip gets right, read from its
pixels and its sound only (never a latent), as an evaluator would.

It shares nothing with the training rewards (rewards/sync.py reads generic onset and motion
envelopes, sync_metrics.py): here each object of the prompt is found by its colour, its strikes
are the frames where it touches the floor, and its sounds are onsets in the band of its colour's
pitch. Per object:

- `color`: the object is there (its colour covers at least half a small square on most frames);
- `size`: its side (the square root of its area) within a pixel of the prompt's size;
- `count`: as many strikes seen as heard as the prompt says;
- `in_sync`: every strike seen has a strike heard within one frame and the other way round (one
  to one), at least one of each;
- `abs_offset_frames`: how far the heard strikes are from the seen ones: the shift that lines the
  most of them up (within half a frame), its size in frames.

A clip's fact is right when it is right for every object. Health signs: `flooded` (over half the
frame off the background on some frame), `noisy` (a colour's band sounding over half the clip),
`frozen` (an object that never moves a pixel), and `distinct_strikes`, the diversity within a
prompt: the distinct strike patterns (the frames each object strikes on) among a prompt's samples
in one batch, over their number (the world's own clips: 0.66 at 16 samples a prompt, 0.84 at 8; a
policy that always draws the same bounce: 1 / samples).
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

import torch

from . import tiny_sync as world
from .tiny_clip import bin_frequency

CONTACT_PX = 0.5  # an object this close to the floor touches it
COLOR_MISS = (
    0.12  # a pixel belongs to a colour's object when it lies this close to the background-to-colour line
)
PRESENT_SHARE = 0.5  # of the frames an object must be seen on
MAX_SHIFT = 4.0  # frames: a sound further from every strike is no strike's
ATTRIBUTES = ("color", "size", "count", "in_sync")
HEALTH = ("flooded", "noisy", "frozen")
MEASURES = ("matched_share", "abs_offset_frames", "seen_strikes", "heard_strikes")
DIVERSITY = ("distinct_strikes",)


def color_alpha(frames: torch.Tensor, color: str) -> torch.Tensor:
    """How much of each pixel [T, H, W] is `color` over the background (0 where a pixel is some
    other colour): its position along the background-to-colour line, when it lies near that line."""
    target = torch.tensor(world.COLORS[color], dtype=frames.dtype)[None, :, None, None]
    direction = target - world.BACKGROUND
    offset = frames - world.BACKGROUND
    alpha = (offset * direction).sum(1) / direction.square().sum()
    residual = (offset - alpha[:, None] * direction).square().sum(1).sqrt()
    return torch.where(residual <= COLOR_MISS, alpha.clamp(0, 1), torch.zeros_like(alpha))


@dataclass(frozen=True)
class Track:
    """One colour's object through a clip: its area (px^2) and height above the floor (px) per frame."""

    area: torch.Tensor
    height: torch.Tensor

    @property
    def seen(self) -> torch.Tensor:
        return self.area >= 0.5 * world.SIZES["small"] ** 2

    def strikes(self) -> list[int]:
        """Frames where it is seen touching the floor, lower than (or as low as) both neighbours;
        touching on consecutive frames is one strike, at the middle one."""
        touching = [
            t
            for t in range(len(self.height))
            if self.seen[t]
            and self.height[t] <= CONTACT_PX
            and all(self.height[t] <= self.height[u] for u in (t - 1, t + 1) if 0 <= u < len(self.height))
        ]
        runs: list[list[int]] = []
        for t in touching:
            if runs and t == runs[-1][-1] + 1:
                runs[-1].append(t)
            else:
                runs.append([t])
        return [run[len(run) // 2] for run in runs]


def track(frames: torch.Tensor, color: str) -> Track:
    """The `color` object's area and the height of its bottom edge above the floor, per frame (a
    frame where it is not seen has height inf)."""
    alpha = color_alpha(frames, color)  # [T, H, W]
    area = alpha.sum((1, 2))
    rows = alpha.sum(2)  # [T, H]: how much of each row it covers
    side = area.clamp(min=1e-6).sqrt()
    centre = (rows * (torch.arange(world.SIZE, dtype=frames.dtype) + 0.5)).sum(1) / area.clamp(min=1e-6)
    bottom = centre + (rows.sum(1) / side) / 2
    height = torch.where(area > 0, world.SIZE - bottom, torch.full_like(area, math.inf))
    return Track(area, height)


@functools.cache
def _full_band_amplitude(bin_index: int) -> float:
    """The band amplitude `band_amplitude` reads for a sound at full loudness in `bin_index`."""
    amps = torch.zeros(1, world.AUDIO_FRAMES, world.AUDIO_BINS)
    amps[0, :, bin_index] = 1.0
    return float(band_amplitude(world.render_audio(amps)[0, 0], bin_index)[world.AUDIO_FRAMES // 2])


def band_amplitude(wave: torch.Tensor, bin_index: int) -> torch.Tensor:
    """The amplitude at bin `bin_index`'s frequency [AUDIO_FRAMES], in windows of one envelope frame
    centred on times j / (FPS * HOPS_PER_FRAME) (a single-frequency DFT, Hann-weighted)."""
    hop = world.SAMPLE_RATE / (world.FPS * world.HOPS_PER_FRAME)
    freq = float(bin_frequency(bin_index))
    reach = int(hop)
    offsets = torch.arange(-reach, reach + 1, dtype=torch.float64)
    window = torch.hann_window(len(offsets) + 2, periodic=False, dtype=torch.float64)[1:-1]
    centres = (torch.arange(world.AUDIO_FRAMES, dtype=torch.float64) * hop).round()
    index = (centres[:, None] + offsets[None]).long()
    inside = (index >= 0) & (index < len(wave))
    samples = torch.where(inside, wave.double()[index.clamp(0, len(wave) - 1)], torch.zeros(()))
    phase = 2 * math.pi * freq * index.double() / world.SAMPLE_RATE
    real = (samples * window * torch.cos(phase)).sum(1)
    imag = (samples * window * torch.sin(phase)).sum(1)
    return (real.square() + imag.square()).sqrt().float()


def heard_strikes(wave: torch.Tensor, color: str) -> tuple[list[float], float]:
    """Onsets (in video frames) of sounds in `color`'s band: where its amplitude rises through half
    of a full-loudness strike's after having been under a quarter of it; and the share of the clip
    the band sounds (over a quarter)."""
    pitch = world.PITCH_BINS[color]
    amplitude = band_amplitude(wave, pitch) / _full_band_amplitude(pitch)
    onsets, armed = [], True
    for j in range(1, len(amplitude)):
        low, high = float(amplitude[j - 1]), float(amplitude[j])
        if armed and low < 0.5 <= high:
            crossing = j - 1 + (0.5 - low) / (high - low)
            onsets.append(crossing / world.HOPS_PER_FRAME)
            armed = False
        elif high < 0.25:
            armed = True
    return onsets, float((amplitude > 0.25).float().mean())


def pair_up(seen: list[int], heard: list[float], window: float = 1.0) -> int:
    """Strikes seen and heard paired one to one within `window` frames, closest first."""
    pairs = sorted((abs(s - h), i, j) for i, s in enumerate(seen) for j, h in enumerate(heard))
    used_seen: set[int] = set()
    used_heard: set[int] = set()
    for gap, i, j in pairs:
        if gap <= window + 1e-9 and i not in used_seen and j not in used_heard:
            used_seen.add(i)
            used_heard.add(j)
    return len(used_seen)


def best_shift(seen: list[int], heard: list[float], reach: float = MAX_SHIFT) -> float:
    """The shift (frames, positive: late) that lines the most heard strikes up with seen ones
    (within half a frame, one to one), among the differences of a heard and a seen strike within
    `reach`; ties go to the smaller shift, then to the mean difference of the pairs it lines up.
    NaN without a strike of each within reach."""
    candidates = [h - s for s in seen for h in heard if abs(h - s) <= reach]
    if not candidates:
        return math.nan

    def lined_up(shift: float) -> int:
        return pair_up(seen, [h - shift for h in heard], window=0.5)

    best = max(candidates, key=lambda d: (lined_up(d), -abs(d)))
    close = [d for d in candidates if abs(d - best) <= 0.5]
    return statistics.fmean(close)


def judge_object(frames: torch.Tensor, wave: torch.Tensor, spec: world.ObjectSpec) -> dict[str, float]:
    """One object of a prompt in one clip: each attribute (1 or 0) and the measures."""
    path = track(frames, spec.color)
    seen_share = float(path.seen.float().mean())
    seen = path.strikes()
    heard, sounding = heard_strikes(wave, spec.color)
    matched = pair_up(seen, heard)
    side = float(path.area[path.seen].sqrt().median()) if bool(path.seen.any()) else 0.0
    offset = best_shift(seen, heard)
    visible_heights = path.height[path.seen]
    return {
        "color": float(seen_share >= PRESENT_SHARE),
        "size": float(abs(side - world.SIZES[spec.size]) <= 1.0),
        "count": float(len(seen) == len(heard) == spec.count),
        "in_sync": float(0 < matched == len(seen) == len(heard)),
        "matched_share": matched / len(seen) if seen else 0.0,
        "abs_offset_frames": abs(offset),
        "seen_strikes": float(len(seen)),
        "heard_strikes": float(len(heard)),
        "noisy": float(sounding > 0.5),
        "frozen": float(
            len(visible_heights) < 2 or float(visible_heights.max() - visible_heights.min()) < 1.0
        ),
    }


def judge_clip(frames: torch.Tensor, wave: torch.Tensor, prompt: str) -> dict[str, float]:
    """A clip against its prompt: each attribute right for every object (1 or 0), `all_correct`, the
    measures averaged over the objects and the health signs."""
    objects = [judge_object(frames, wave, spec) for spec in world.parse_prompt(prompt)]
    off_background = (frames - world.BACKGROUND).abs().amax(1) > 0.05  # [T, H, W]
    verdict = {name: min(o[name] for o in objects) for name in ATTRIBUTES}
    verdict["all_correct"] = min(verdict.values())
    for name in MEASURES:
        values = [o[name] for o in objects if not math.isnan(o[name])]
        verdict[name] = statistics.fmean(values) if values else math.nan
    verdict["flooded"] = float(float(off_background.float().mean((1, 2)).max()) > 0.5)
    verdict["noisy"] = max(o["noisy"] for o in objects)
    verdict["frozen"] = max(o["frozen"] for o in objects)
    return verdict


def judge_clips(video: torch.Tensor, audio: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
    """Every clip of a batch (video [B, T, 3, H, W], audio [B, C, S] at the world's rate): each
    verdict as a tensor [B]."""
    verdicts = [
        judge_clip(v, a.mean(0), p) for v, a, p in zip(video.float(), audio.float(), prompts, strict=True)
    ]
    columns = {k: torch.tensor([v[k] for v in verdicts]) for k in verdicts[0]}
    patterns = [strike_pattern(v, p) for v, p in zip(video.float(), prompts, strict=True)]
    columns["distinct_strikes"] = distinct_share(patterns, prompts)
    return columns


def strike_pattern(frames: torch.Tensor, prompt: str) -> tuple[tuple[int, ...], ...]:
    """The frames each object of the prompt is seen striking on."""
    return tuple(tuple(track(frames, spec.color).strikes()) for spec in world.parse_prompt(prompt))


def distinct_share(patterns: list[tuple[tuple[int, ...], ...]], prompts: list[str]) -> torch.Tensor:
    """Per sample [B]: the share of its prompt's samples whose pattern is distinct (the number of
    distinct patterns over the number of samples of that prompt)."""
    groups: dict[str, list[tuple[tuple[int, ...], ...]]] = {}
    for pattern, prompt in zip(patterns, prompts, strict=True):
        groups.setdefault(prompt, []).append(pattern)
    return torch.tensor([len(set(groups[p])) / len(groups[p]) for p in prompts])
