"""Audio-visual synchrony and event counts of any clip, by signal processing alone.

A clip is video frames [T, C, H, W] in [0, 1] at `fps` and a waveform [S] (or [channels, S], mixed to
mono) at `sample_rate`. Both modalities become envelopes on one time grid, `hops_per_frame` points a
video frame:

- **audio onset strength**: the rise of log energy from one short window to the next (windows one
  hop long, the window of point i centred on time i / rate), kept where it is 6 dB or more, so a
  sound starting at time t rises at the point of t;
- **visual motion**: the mean absolute difference of consecutive frames, placed at the midpoint of
  the two frames' times (an object fastest at a strike moves most in the two intervals around it),
  over the whole picture and in each of `motion_columns` vertical strips. With `motion_at="frames"`
  each visual event is then moved onto a whole frame, the one the motion turns at (`on_whole_frames`).

Events are the envelopes' peaks: a point above `relative_threshold` of its envelope's largest value,
the largest within `min_gap_frames` on either side and standing `prominence` of its height above the
lowest point there (a steady glide's ripple is no event), its time refined by a parabola through its
neighbours. With `motion_columns` above 1, visual events are read strip by strip (against the
largest motion of any strip), so that an object's strike is not lost in the motion of another beside
it; peaks in neighbouring strips within `min_gap_frames` of each other are one event (an object
across a strip's edge), at the time of the highest. The cost: an object gliding sideways makes an
event each time it crosses into a strip, so the default reads the whole picture, as AV-Align does.
From these:

- `events_matched`: audio and visual events paired one to one, closest first, within
  `match_frames` video frames, and AV-Align's score, the intersection over union of the two event
  sets (pairs / (audio events + visual events - pairs); 0 when neither has an event: nothing is in
  sync);
- `offset_ms`: where the cross-correlation of the two envelopes peaks, within `max_offset_s`;
  positive when the sound comes after the picture (NaN when either envelope is flat);
- the event count of each modality;
- each audio event's pitch (`onset_pitches`: what rises in the spectrum at it) and each visual
  event's strip, from which `sound_sources` groups the sounds by pitch: how many times each source
  sounds, where a count of all events cannot tell one object striking three times from two objects
  striking once and twice.

The functions are pure and work on any clip at any size and rate (real ones too: `odrl eval sync`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

LOG_FLOOR = 1e-8  # energy floor before the log (silence)
TOP_SHARE = 0.9  # the cross-correlation's top: the lags within 10% of its peak
FLAT = 1e-6  # values this close (relative) are equal: a flat top, one peak at its centre
MIN_ONSET_RISE = math.log(10**0.6)  # an onset raises the energy by 6 dB or more from one window to the next
SAME_SOURCE_OCTAVES = 1 / 6  # onsets this close in pitch (two semitones) are one sound source
MOTION_READINGS = ("between_frames", "frames")


@dataclass(frozen=True)
class SyncSettings:
    """How envelopes and events are read; every duration in video frames."""

    hops_per_frame: int = 4
    match_frames: float = 1.0  # AV-Align's window: an audio and a visual event within one frame match
    min_gap_frames: float = 2.0  # two peaks closer than this are one event
    motion_columns: int = 1  # vertical strips whose motion is read apart (1: the whole picture)
    relative_threshold: float = 0.3  # a peak must reach this fraction of its envelope's largest value
    prominence: float = 0.15  # and stand this fraction of its height above the lowest point near it
    max_offset_s: float = 0.5
    # when a visual event happens: "between_frames" (AV-Align's reading: at the peak of the motion
    # placed between frames) or "frames" (the same events, each moved onto the frame where the
    # motion turns back: `on_whole_frames`)
    motion_at: str = "between_frames"

    def __post_init__(self) -> None:
        if self.motion_at not in MOTION_READINGS:
            raise ValueError(f"motion_at must be one of {', '.join(MOTION_READINGS)}; got {self.motion_at!r}")
        if self.hops_per_frame < 1 or self.motion_columns < 1:
            raise ValueError(
                f"hops_per_frame and motion_columns must be at least 1; got {self.hops_per_frame} and "
                f"{self.motion_columns}"
            )
        for name in ("relative_threshold", "prominence"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1); got {getattr(self, name)}")
        if self.match_frames < 0 or self.min_gap_frames <= 0 or self.max_offset_s <= 0:
            raise ValueError("match_frames must be >= 0, min_gap_frames and max_offset_s > 0")


DEFAULT_SYNC = SyncSettings()


@dataclass(frozen=True)
class SyncReport:
    """One clip's synchrony: event times (s), counts, AV-Align's IoU and the envelopes' offset."""

    audio_events_s: tuple[float, ...]
    visual_events_s: tuple[float, ...]
    matched: int
    iou: float
    offset_ms: float
    audio_event_hz: tuple[float, ...] = ()  # the pitch each audio event brings (onset_pitches)
    visual_event_strips: tuple[int, ...] = ()  # the strip of each visual event (0: the leftmost)

    @property
    def audio_count(self) -> int:
        return len(self.audio_events_s)

    @property
    def visual_count(self) -> int:
        return len(self.visual_events_s)

    def as_dict(self) -> dict[str, object]:
        return {
            "audio_events_s": list(self.audio_events_s),
            "visual_events_s": list(self.visual_events_s),
            "audio_count": self.audio_count,
            "visual_count": self.visual_count,
            "matched": self.matched,
            "iou": self.iou,
            "offset_ms": self.offset_ms,
            "audio_event_hz": list(self.audio_event_hz),
            "visual_event_strips": list(self.visual_event_strips),
        }


def mono(wave: torch.Tensor) -> torch.Tensor:
    """[S] or [channels, S] -> [S] float32."""
    if wave.ndim == 2:
        wave = wave.mean(0)
    if wave.ndim != 1:
        raise ValueError(f"a waveform is [S] or [channels, S]; got {tuple(wave.shape)}")
    return wave.float()


def audio_onset_envelope(wave: torch.Tensor, sample_rate: int, rate: float, points: int) -> torch.Tensor:
    """Onset strength [points] at times i / rate: the rise of log energy from the window before
    point i to the window centred on it (each window 1 / rate long), where it is 6 dB or more
    (less is a sound going on, not starting); 0 at the first point."""
    x = mono(wave)
    hop = sample_rate / rate
    if hop < 1:
        raise ValueError(f"{sample_rate} Hz is too coarse for {rate} envelope points a second")
    # window i covers samples [(i - 1/2) hop, (i + 1/2) hop); one window more before the first point
    edges = torch.round((torch.arange(-1, points + 1, dtype=torch.float64) - 0.5) * hop).long()
    cumulative = torch.cat([torch.zeros(1), torch.cumsum(x.double().square(), 0)])
    clamped = edges.clamp(0, len(x))
    covered = (clamped[1:] - clamped[:-1]).clamp(min=1)  # the clip's first window is half one
    energy = (cumulative[clamped[1:]] - cumulative[clamped[:-1]]) / covered
    log_energy = torch.log(energy + LOG_FLOOR)
    rise = torch.relu(log_energy[1:] - log_energy[:-1]).float()
    rise[0] = 0  # nothing of the clip comes before its first window: a sound already on is no onset
    return torch.where(rise >= MIN_ONSET_RISE, rise, torch.zeros_like(rise))


def frame_differences(frames: torch.Tensor, columns: int, step: int = 1) -> torch.Tensor:
    """The mean absolute difference of frames t - step and t [columns, T - step] in each of `columns`
    vertical strips (as equal as the width allows; at most one a pixel column)."""
    if frames.ndim != 4 or frames.shape[0] < 2:
        raise ValueError(f"frames must be [T >= 2, C, H, W]; got {tuple(frames.shape)}")
    columns = min(columns, frames.shape[-1])
    # a pair of frames at a time: a long clip never has a second full-size copy
    return torch.stack(
        [
            torch.stack(
                [
                    strip.mean()
                    for strip in (frames[t].float() - frames[t - step].float())
                    .abs()
                    .tensor_split(columns, -1)
                ]
            )
            for t in range(step, len(frames))
        ],
        1,
    ).reshape(columns, max(len(frames) - step, 0))


def turning(frames: torch.Tensor, columns: int, step: torch.Tensor | None = None) -> torch.Tensor:
    """How much the motion of each strip turns back at each frame [columns, T]: the way from frame
    t - 1 to t and on to t + 1, less the way from t - 1 straight to t + 1. About 0 where things move
    on in one direction, large where they come back (a bounce, a strike); 0 at the first and last
    frames. `step`: the clip's `frame_differences` when already computed."""
    step = frame_differences(frames, columns) if step is None else step
    out = torch.zeros(step.shape[0], len(frames))
    if len(frames) > 2:
        out[:, 1:-1] = step[:, :-1] + step[:, 1:] - frame_differences(frames, columns, step=2)
    return out


def motion_strips(differences: torch.Tensor, fps: float, rate: float, points: int) -> torch.Tensor:
    """Visual motion of each strip [columns, points] at times i / rate: `frame_differences`' value
    of frames t - 1 and t placed at (t - 1/2) / fps, linearly interpolated between those midpoints
    (0 outside them)."""
    midpoints = (torch.arange(1, differences.shape[1] + 1, dtype=torch.float64) - 0.5) / fps
    times = torch.arange(points, dtype=torch.float64) / rate
    return torch.stack([_interpolate(times, midpoints, m.double()).float() for m in differences])


def on_whole_frames(
    events: list[tuple[float, int]], turned: torch.Tensor, fps: float
) -> list[tuple[float, int]]:
    """Visual events (time in s, strip) moved onto a whole frame: of the frames just before and after
    the event (or the one it sits on), the one where the motion of its strip turns back most
    (`turning`). Motion placed between frames peaks off the contact when it is faster on one side
    of it than the other (a generator's bounce often is): half a frame off, the sound a frame early
    and the sound on the strike then earn the same."""
    placed = []
    last = turned.shape[1] - 1
    for at, strip in events:
        position = at * fps
        around = {min(max(math.floor(position), 0), last), min(max(math.ceil(position), 0), last)}
        best = max(sorted(around), key=lambda t: (float(turned[strip, t]), -abs(t - position)))
        placed.append((best / fps, strip))
    return placed


def _interpolate(times: torch.Tensor, at: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """`values` known at the increasing times `at`, linearly interpolated at `times` (0 outside)."""
    out = torch.zeros_like(times)
    inside = (times >= at[0]) & (times <= at[-1])
    if len(at) == 1:
        out[inside] = values[0]
        return out
    index = torch.searchsorted(at, times[inside], right=True).clamp(1, len(at) - 1)
    lo, hi = at[index - 1], at[index]
    weight = (times[inside] - lo) / (hi - lo)
    out[inside] = values[index - 1] * (1 - weight) + values[index] * weight
    return out


def envelope_events(
    envelope: torch.Tensor, rate: float, min_gap_points: float, relative: float, prominence: float
) -> list[float]:
    """Peak times (s) of `envelope` sampled at `rate`, in order: its local maxima (a flat top is one,
    at its centre; others refined by a parabola through their neighbours) that reach `relative` of
    its largest value and stand `prominence` of their height above the lowest point within
    `min_gap_points` (the envelope's start and end count as 0), the highest first, each kept only
    when no kept one is within `min_gap_points` of it."""
    largest = float(envelope.max()) if len(envelope) else 0.0
    return [at / rate for _, at in _peaks(envelope, min_gap_points, relative * largest, prominence)]


def strip_events(
    strips: torch.Tensor, rate: float, min_gap_points: float, relative: float, prominence: float
) -> list[float]:
    """Event times (s) of envelopes side by side [columns, points], in order: each strip's peaks as
    `envelope_events` reads them but against the largest value of any strip, and peaks of
    neighbouring strips within `min_gap_points` of each other joined into one event (chains too), at
    the time of its highest peak."""
    return [at for at, _ in strip_event_columns(strips, rate, min_gap_points, relative, prominence)]


def strip_event_columns(
    strips: torch.Tensor, rate: float, min_gap_points: float, relative: float, prominence: float
) -> list[tuple[float, int]]:
    """`strip_events` with the strip of each event's highest peak: (time in s, strip), in time order."""
    level = relative * (float(strips.max()) if strips.numel() else 0.0)
    peaks = sorted(
        (height, at, column)
        for column, envelope in enumerate(strips)
        for height, at in _peaks(envelope, min_gap_points, level, prominence)
    )  # lowest first: joining keeps the later (higher) peak's time
    events: list[list[tuple[float, float, int]]] = []
    for peak in peaks:
        joined = [
            e
            for e in events
            if any(abs(p[2] - peak[2]) <= 1 and abs(p[1] - peak[1]) < min_gap_points for p in e)
        ]
        for e in joined:
            events.remove(e)
        events.append([p for e in joined for p in e] + [peak])
    return sorted((max(e)[1] / rate, max(e)[2]) for e in events)


def _peaks(
    envelope: torch.Tensor, min_gap_points: float, level: float, prominence: float
) -> list[tuple[float, float]]:
    """(height, position in points) of `envelope`'s peaks that reach `level` (see envelope_events)."""
    largest = float(envelope.max()) if len(envelope) else 0.0
    if largest <= 0 or largest < level:
        return []
    reach = max(1, math.floor(min_gap_points))
    padded = torch.nn.functional.pad(envelope[None, None], (1, 1))[0, 0]
    rising = padded[1:-1] > padded[:-2] * (1 + FLAT)
    not_falling = padded[1:-1] >= padded[2:] * (1 - FLAT)
    floor = torch.nn.functional.pad(envelope[None, None], (reach, reach))[0, 0].unfold(0, 2 * reach + 1, 1)
    standing = (envelope >= level) & (envelope - floor.min(1).values >= prominence * envelope)
    candidates = []
    for i in (rising & not_falling & standing).nonzero().flatten().tolist():
        at = refined_peak(envelope, i, 2 * reach)
        if at is not None:
            candidates.append((-float(envelope[i]), at))
    kept: list[tuple[float, float]] = []
    for height, at in sorted(candidates):
        if all(abs(at - other) >= min_gap_points for _, other in kept):
            kept.append((-height, at))
    return sorted(kept, key=lambda peak: peak[1])


def refined_peak(values: torch.Tensor, index: int, widest: int) -> float | None:
    """The fractional position of the peak at `index` (the first of equal values): the centre of a
    flat top (values equal to it, to rounding, after it; None when it is over `widest` points long,
    a steady state rather than an event), else the vertex of the parabola through it and its
    neighbours."""
    top = float(values[index])
    last = index
    while last + 1 < len(values) and abs(float(values[last + 1]) - top) <= FLAT * abs(top):
        last += 1
    if last - index > widest:
        return None
    if last > index:
        return (index + last) / 2
    if not 0 < index < len(values) - 1:
        return float(index)
    left, right = float(values[index - 1]), float(values[index + 1])
    curvature = left - 2 * top + right
    return index + (0.5 * (left - right) / curvature if curvature < 0 else 0.0)


def onset_pitches(
    wave: torch.Tensor, sample_rate: int, onsets_s: list[float], window_s: float
) -> list[float]:
    """The frequency (Hz) each onset brings: the peak of the magnitude spectrum of the `window_s`
    after it less that of the `window_s` before it (Hann windows zero-padded to four times their
    length, the peak refined by a parabola through its neighbours), so that a sound still ringing
    from before is not the new one's; NaN where no frequency rises."""
    x = mono(wave).double()
    length = max(8, round(window_s * sample_rate))
    window = torch.hann_window(length, periodic=False, dtype=torch.float64)
    size = 4 * length

    def spectrum(start: int) -> torch.Tensor:
        index = torch.arange(start, start + length)
        inside = (index >= 0) & (index < len(x))
        segment = torch.where(inside, x[index.clamp(0, max(len(x) - 1, 0))], torch.zeros((), dtype=x.dtype))
        return torch.fft.rfft(segment * window, n=size).abs()

    pitches = []
    for onset in onsets_s:
        start = round(onset * sample_rate)
        rise = (spectrum(start) - spectrum(start - length)).clamp(min=0)
        rise[0] = 0  # a step in level is no pitch
        k = int(rise.argmax())
        if float(rise[k]) <= 0:
            pitches.append(math.nan)
            continue
        shift = 0.0
        if 0 < k < len(rise) - 1:
            left, top, right = float(rise[k - 1]), float(rise[k]), float(rise[k + 1])
            curvature = left - 2 * top + right
            shift = 0.5 * (left - right) / curvature if curvature < 0 else 0.0
        pitches.append((k + shift) * sample_rate / size)
    return pitches


def sound_sources(pitches_hz: list[float], within_octaves: float = SAME_SOURCE_OCTAVES) -> list[int]:
    """A source number for each onset: onsets whose pitches are within `within_octaves` of a
    neighbour's (in pitch order, chains too) are one source, numbered from the lowest; every onset
    of no pitch (NaN) is one source more."""
    order = sorted((p, i) for i, p in enumerate(pitches_hz) if not math.isnan(p))
    sources = [-1] * len(pitches_hz)
    number = -1
    for rank, (pitch, i) in enumerate(order):
        if rank == 0 or math.log2(pitch / order[rank - 1][0]) > within_octaves:
            number += 1
        sources[i] = number
    return [number + 1 if s < 0 else s for s in sources]


def match_events(audio: list[float], visual: list[float], window_s: float) -> int:
    """Pairs of one audio and one visual event within `window_s` of each other, each event in at
    most one pair, the closest pairs first."""
    gaps = sorted((abs(a - v), i, j) for i, a in enumerate(audio) for j, v in enumerate(visual))
    return len(one_to_one(pair for pair in gaps if pair[0] <= window_s + 1e-9))


def one_to_one(ranked: Iterable[tuple[float, int, int]]) -> list[tuple[float, int, int]]:
    """Of candidate pairs (value, left, right) in the order given, those whose left and right are
    both still free when their turn comes: a greedy one-to-one pairing, best first."""
    used_left: set[int] = set()
    used_right: set[int] = set()
    kept = []
    for value, left, right in ranked:
        if left not in used_left and right not in used_right:
            used_left.add(left)
            used_right.add(right)
            kept.append((value, left, right))
    return kept


def envelope_offset_s(audio: torch.Tensor, visual: torch.Tensor, rate: float, max_offset_s: float) -> float:
    """The lag (s) at which the audio envelope best matches the visual one, positive when the sound
    comes later: the centre of the top of their cross-correlation (each envelope scaled to norm 1)
    within ±max_offset_s; NaN when either envelope is zero."""
    a, v = audio.double(), visual.double()  # not centred: a centred pair favours short lags (more overlap)
    if float(a.norm()) == 0 or float(v.norm()) == 0:
        return math.nan
    a, v = a / a.norm(), v / v.norm()
    lags = range(
        -min(len(a) - 1, round(max_offset_s * rate)), min(len(a) - 1, round(max_offset_s * rate)) + 1
    )
    scores = torch.tensor([_lagged_dot(a, v, lag) for lag in lags], dtype=torch.float64)
    return (lags[0] + top_centroid(scores, TOP_SHARE)) / rate


def top_centroid(values: torch.Tensor, share: float) -> float:
    """The fractional position of `values`' largest value: the centroid of the contiguous run of
    values around it that reach `share` of it, weighted by their excess over that level (a top
    tilted by noise keeps its centre, where an argmax would jump to one end)."""
    best = int(values.argmax())
    level = share * float(values[best])
    lo, hi = best, best
    while lo > 0 and float(values[lo - 1]) >= level:
        lo -= 1
    while hi + 1 < len(values) and float(values[hi + 1]) >= level:
        hi += 1
    weights = values[lo : hi + 1] - level
    if float(weights.sum()) <= 0:
        return float(best)
    return lo + float((weights * torch.arange(hi - lo + 1, dtype=values.dtype)).sum() / weights.sum())


def _lagged_dot(a: torch.Tensor, v: torch.Tensor, lag: int) -> float:
    """sum_t a[t + lag] v[t] over the overlap."""
    if lag >= 0:
        return float((a[lag:] * v[: len(v) - lag]).sum())
    return float((a[: len(a) + lag] * v[-lag:]).sum())


@dataclass(frozen=True)
class SyncEnvelopes:
    """A clip's two envelopes on one time grid: `rate` points a second (`points_per_frame` a video
    frame), point i at time i / rate; `visual` is the whole picture's motion, `strips` each vertical
    strip's [columns, points], read from `differences` (`frame_differences`, [columns, T - 1])."""

    rate: float
    audio: torch.Tensor
    visual: torch.Tensor
    points_per_frame: int
    strips: torch.Tensor
    differences: torch.Tensor


def sync_envelopes(
    frames: torch.Tensor,
    fps: float,
    wave: torch.Tensor,
    sample_rate: int,
    settings: SyncSettings = DEFAULT_SYNC,
) -> SyncEnvelopes:
    """The audio onset strength and the visual motion of a clip, `settings.hops_per_frame` points a
    video frame, over the longer of its picture and its sound."""
    if fps <= 0 or sample_rate <= 0:
        raise ValueError(f"fps and sample_rate must be positive; got {fps} and {sample_rate}")
    rate = fps * settings.hops_per_frame
    duration = max(len(frames) / fps, mono(wave).shape[0] / sample_rate)
    points = max(2, math.ceil(duration * rate))
    differences = frame_differences(frames, settings.motion_columns)
    strips = motion_strips(differences, fps, rate, points)
    widths = torch.tensor([len(c) for c in torch.arange(frames.shape[-1]).tensor_split(len(strips))])
    visual = (strips * widths[:, None]).sum(0) / widths.sum()  # the whole picture's mean
    return SyncEnvelopes(
        rate,
        audio_onset_envelope(wave, sample_rate, rate, points),
        visual,
        settings.hops_per_frame,
        strips,
        differences,
    )


def sync_report(
    frames: torch.Tensor,
    fps: float,
    wave: torch.Tensor,
    sample_rate: int,
    settings: SyncSettings = DEFAULT_SYNC,
) -> SyncReport:
    """The synchrony of one clip: its audio and visual events, their matches, AV-Align's IoU and the
    envelopes' offset."""
    env = sync_envelopes(frames, fps, wave, sample_rate, settings)
    gap = settings.min_gap_frames * settings.hops_per_frame
    read = (env.rate, gap, settings.relative_threshold, settings.prominence)
    audio_events = envelope_events(env.audio, *read)
    visual = strip_event_columns(env.strips, *read)
    if settings.motion_at == "frames":
        visual = on_whole_frames(visual, turning(frames, settings.motion_columns, env.differences), fps)
    visual_events = [at for at, _ in visual]
    matched = match_events(audio_events, visual_events, settings.match_frames / fps)
    union = len(audio_events) + len(visual_events) - matched
    return SyncReport(
        audio_events_s=tuple(audio_events),
        visual_events_s=tuple(visual_events),
        matched=matched,
        iou=matched / union if union else 0.0,
        offset_ms=1000 * envelope_offset_s(env.audio, env.visual, env.rate, settings.max_offset_s),
        audio_event_hz=tuple(onset_pitches(wave, sample_rate, audio_events, 1 / fps)),
        visual_event_strips=tuple(strip for _, strip in visual),
    )
