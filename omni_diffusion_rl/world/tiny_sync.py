"""The tiny sync world: objects that bounce on the floor, each strike a sound on the strike's frame.

Every fact of the world lives here, so that an evaluator can read them without reading the rewards:

- **A clip** is FRAMES frames of SIZE x SIZE pixels at FPS (one second) on a dark background, and
  one second of mono audio at SAMPLE_RATE. Its audio is an amplitude envelope of AUDIO_FRAMES
  frames (HOPS_PER_FRAME a video frame, so a one-frame offset is four envelope frames) over
  AUDIO_BINS frequency bins, synthesised into a waveform by the fixed vocoder of `tiny_clip`.
- **An object** is a square of a colour (COLORS) and a size (SIZES, its side in pixels) in a column
  of the frame. It strikes the floor (the bottom row) on each of its strike frames: it touches the
  floor exactly then. Between strikes it flies a parabolic arc that moves IMPACT_SPEED pixels in the
  frame before and in the frame after every strike (less than a small object's side), so the
  picture moves most, and as much on either side, around a strike. Before its first strike it is
  held still at the top of such an arc (LEAD_GAP frames long) and falls from there; after its last
  it rises to the top of one and stays there.
- **A strike's sound** starts on the strike's frame: its colour's pitch (PITCH_BINS, with a quieter
  octave above for timbre) decaying by DECAY a envelope frame. The sound rises between the envelope
  frames around the strike's time, so its onset is the strike's time.
- **Counts**: an object strikes 1 to 3 times (COUNT_WORDS), at least MIN_GAP frames apart, within
  FIRST_STRIKE..LAST_STRIKE.
- **Prompts** name each object's size, colour, count and sound: "a small red square bounces twice
  with a low thud". A second object may follow ("..., and a large blue square bounces once with a
  knock"). Held-out prompts are combinations never trained on, and other wordings of them.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import torch

from .tiny_clip import bin_frequency, synthesize

FRAMES, SIZE, FPS = 16, 16, 16.0
HOPS_PER_FRAME = 4
AUDIO_FRAMES, AUDIO_BINS, SAMPLE_RATE = FRAMES * HOPS_PER_FRAME, 16, 8000
DURATION_S = FRAMES / FPS
BACKGROUND = 0.1
COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.8, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.15),
}
SIZES = {"small": 3, "large": 5}
SOUNDS = {"red": "low thud", "blue": "knock", "green": "clink", "yellow": "high ping"}
"""The sound each colour makes when it strikes (the prompt names it)."""
PITCH_BINS = {"red": 0, "blue": 3, "green": 7, "yellow": 11}
OVERTONE, OVERTONE_GAIN = 4, 0.4  # an octave up (4 bins), quieter: a struck object, not a sine
DECAY = 0.55  # the sound's amplitude kept from one envelope frame to the next (about 42 ms to 1/e)
IMPACT_SPEED = 2.0  # pixels moved in the frame before and in the frame after every strike
COUNT_WORDS = {1: "once", 2: "twice", 3: "three times"}
FIRST_STRIKE, LAST_STRIKE, MIN_GAP, LEAD_GAP = 3, 12, 4, 6
COLUMNS = tuple(range(1, SIZE - 6))  # an object's left column (a large one fits on every one)
HELD_OUT_COMBINATIONS = {
    ("green", "small", 2),
    ("blue", "large", 3),
    ("yellow", "small", 1),
    ("red", "large", 2),
}
"""(colour, size, count) never trained on, alone or as either object of two."""


@dataclass(frozen=True)
class Bouncer:
    """One object: its colour, size, column and strike frames (increasing)."""

    color: str
    size: str
    column: int
    strikes: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.color not in COLORS or self.size not in SIZES:
            raise ValueError(
                f"unknown object {self.size!r} {self.color!r}: sizes {list(SIZES)}, colours {list(COLORS)}"
            )
        if not 1 <= len(self.strikes) <= max(COUNT_WORDS):
            raise ValueError(f"an object strikes 1 to {max(COUNT_WORDS)} times; got {self.strikes}")
        gaps = [b - a for a, b in itertools.pairwise(self.strikes)]
        if (
            any(g < MIN_GAP for g in gaps)
            or not FIRST_STRIKE <= self.strikes[0] <= self.strikes[-1] <= LAST_STRIKE
        ):
            raise ValueError(
                f"strikes {self.strikes}: {MIN_GAP}+ frames apart within {FIRST_STRIKE}..{LAST_STRIKE}"
            )

    @property
    def count(self) -> int:
        return len(self.strikes)

    @property
    def phrase(self) -> str:
        return (
            f"a {self.size} {self.color} square bounces {COUNT_WORDS[self.count]} with a {SOUNDS[self.color]}"
        )

    def height(self, t: torch.Tensor) -> torch.Tensor:
        """Height above the floor (pixels) at frame times t: parabolic arcs between strikes, each
        IMPACT_SPEED pixels high one frame after it leaves the floor and one frame before it lands."""
        ends = [self.strikes[0] - LEAD_GAP, *self.strikes, self.strikes[-1] + LEAD_GAP]
        t = t.double().clamp(ends[0] + LEAD_GAP / 2, ends[-1] - LEAD_GAP / 2)  # held at the lead arcs' tops
        out = torch.zeros_like(t)
        for a, b in itertools.pairwise(ends):
            inside = (t >= a) & (t <= b)
            since = t[inside] - a
            out[inside] = IMPACT_SPEED * since * (b - a - since) / (b - a - 1)
        return out


@dataclass(frozen=True)
class SyncScene:
    """A clip of the world: one or two objects."""

    objects: tuple[Bouncer, ...]

    @property
    def prompt(self) -> str:
        return ", and ".join(o.phrase for o in self.objects)


def render_video(scene: SyncScene) -> torch.Tensor:
    """Frames [FRAMES, 3, SIZE, SIZE] in [0, 1]: each object's square at its height, its top and
    bottom rows covered in part (anti-aliased), so that motion below a pixel shows."""
    frames = torch.full((FRAMES, 3, SIZE, SIZE), BACKGROUND)
    rows = torch.arange(SIZE, dtype=torch.float64)
    times = torch.arange(FRAMES, dtype=torch.float64)
    for obj in scene.objects:
        side = SIZES[obj.size]
        bottom = SIZE - obj.height(times)  # the square's bottom edge, in rows from the top
        top = bottom - side
        # coverage of row r (spanning [r, r + 1)) by [top, bottom)
        cover = (
            torch.minimum(rows[None] + 1, bottom[:, None]) - torch.maximum(rows[None], top[:, None])
        ).clamp(0, 1)
        color = torch.tensor(COLORS[obj.color], dtype=torch.float64)
        columns = slice(obj.column, obj.column + side)
        alpha = cover[:, None, :, None].float()  # [T, 1, rows, 1]
        patch = frames[:, :, :, columns]
        frames[:, :, :, columns] = patch * (1 - alpha) + color.float()[None, :, None, None] * alpha
    return frames


def render_envelope(scene: SyncScene) -> torch.Tensor:
    """Amplitudes [AUDIO_FRAMES, AUDIO_BINS] in [0, 1]: at each strike its colour's pitch and
    overtone, full at the envelope frame centred just after the strike's time and decaying."""
    amps = torch.zeros(AUDIO_FRAMES, AUDIO_BINS)
    frames = torch.arange(AUDIO_FRAMES, dtype=torch.float64)
    for obj in scene.objects:
        for strike in obj.strikes:
            start = (
                strike * HOPS_PER_FRAME
            )  # frame j is centred at (j + 1/2) hops: the rise is centred on the strike
            since = frames - start
            level = torch.where(since >= 0, DECAY**since, torch.zeros_like(since)).float()
            pitch = PITCH_BINS[obj.color]
            amps[:, pitch] = torch.maximum(amps[:, pitch], level)
            amps[:, pitch + OVERTONE] = torch.maximum(amps[:, pitch + OVERTONE], OVERTONE_GAIN * level)
    return amps


def render_audio(amps: torch.Tensor) -> torch.Tensor:
    """Waveforms [B, 1, SAMPLE_RATE * DURATION_S] from envelopes [B, AUDIO_FRAMES, AUDIO_BINS]."""
    return synthesize(amps, SAMPLE_RATE, DURATION_S)


def strike_options(count: int) -> list[tuple[int, ...]]:
    """Every allowed set of `count` strike frames."""
    frames = range(FIRST_STRIKE, LAST_STRIKE + 1)
    return [
        c
        for c in itertools.combinations(frames, count)
        if all(b - a >= MIN_GAP for a, b in itertools.pairwise(c))
    ]


def random_bouncer(rng: random.Random, color: str, size: str, count: int) -> Bouncer:
    return Bouncer(color, size, rng.choice(COLUMNS), rng.choice(strike_options(count)))


def is_held_out(obj: tuple[str, str, int]) -> bool:
    return obj in HELD_OUT_COMBINATIONS


def object_kinds(held_out: bool) -> list[tuple[str, str, int]]:
    """(colour, size, count) of the training split or of the held-out one."""
    every = itertools.product(COLORS, SIZES, COUNT_WORDS)
    return [k for k in every if is_held_out(k) == held_out]


def random_scene(rng: random.Random, held_out: bool = False, second_object: float = 0.0) -> SyncScene:
    """A scene of the split: one object, or with probability `second_object` two of different
    colours in columns apart (a held-out scene has at least one held-out object)."""
    kinds = object_kinds(held_out)
    first = rng.choice(kinds)
    objects = [random_bouncer(rng, *first)]
    if rng.random() < second_object:
        others = [k for k in object_kinds(False) + object_kinds(True) if k[0] != first[0]]
        others = [k for k in others if held_out or not is_held_out(k)]
        second = random_bouncer(rng, *rng.choice(others))
        column = (objects[0].column + SIZE // 2) % (SIZE - 6)
        objects.append(Bouncer(second.color, second.size, max(column, 1), second.strikes))
    return SyncScene(tuple(objects))


def frequency_of(color: str) -> float:
    """The pitch (Hz) of a colour's strike."""
    return float(bin_frequency(PITCH_BINS[color]))


def strike_times_s(scene: SyncScene) -> list[float]:
    """Every strike's time (s), all objects together, sorted."""
    return sorted(s / FPS for o in scene.objects for s in o.strikes)


def clip_tensors(scene: SyncScene) -> tuple[torch.Tensor, torch.Tensor]:
    """(frames [FRAMES, 3, SIZE, SIZE], waveform [1, S]) of a scene."""
    return render_video(scene), render_audio(render_envelope(scene)[None])[0]
