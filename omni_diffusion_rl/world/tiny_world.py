"""The tiny text-to-audio-video world: the embedded default that trains on a laptop CPU.

A prompt names a colour, a shape, a tone's pitch and when it sounds:
"a red circle with a high tone at the start". A clip is 4 frames of 16 x 16 pixels and half a
second of audio. The shape is visible while the tone sounds, so picture and sound are in sync.
The audio latent is an amplitude envelope over 16 frequency bins and 8 time frames; the decoder
synthesises the waveform from it (a fixed, differentiable "vocoder").
"""

from __future__ import annotations

import functools
import itertools
import math
import random
import re
from dataclasses import dataclass

import torch

# The clip format lives below both the world and the tiny model; these names stay importable from here.
from .tiny_clip import AUDIO_BINS as AUDIO_BINS
from .tiny_clip import AUDIO_FRAMES as AUDIO_FRAMES
from .tiny_clip import BACKGROUND as BACKGROUND
from .tiny_clip import DURATION_S as DURATION_S
from .tiny_clip import FPS as FPS
from .tiny_clip import SAMPLE_RATE as SAMPLE_RATE
from .tiny_clip import VIDEO_FRAMES as VIDEO_FRAMES
from .tiny_clip import VIDEO_SIZE as VIDEO_SIZE
from .tiny_clip import bin_frequency as bin_frequency
from .tiny_clip import synthesize_audio as synthesize_audio

COLORS: dict[str, tuple[float, float, float]] = {
    "red": (0.9, 0.15, 0.15),
    "green": (0.15, 0.8, 0.2),
    "blue": (0.2, 0.3, 0.95),
    "yellow": (0.95, 0.85, 0.15),
    "purple": (0.65, 0.2, 0.85),
    "cyan": (0.15, 0.85, 0.85),
}
SHAPES = ("circle", "square")
PITCH_BINS = {"low": 2, "mid": 7, "high": 12}
WHEN_PHRASES = {"early": "at the start", "late": "at the end"}


PITCH_HZ = {name: float(bin_frequency(k)) for name, k in PITCH_BINS.items()}


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    pitch: str
    when: str

    @property
    def prompt(self) -> str:
        return f"a {self.color} {self.shape} with a {self.pitch} tone {WHEN_PHRASES[self.when]}"


ALL_SCENES = [Scene(*combo) for combo in itertools.product(COLORS, SHAPES, PITCH_BINS, WHEN_PHRASES)]
_HELDOUT = set(random.Random(1234).sample(range(len(ALL_SCENES)), 16))
TRAIN_PROMPTS = [s.prompt for i, s in enumerate(ALL_SCENES) if i not in _HELDOUT]
HELDOUT_PROMPTS = [s.prompt for i, s in enumerate(ALL_SCENES) if i in _HELDOUT]

SCENE_BY_PROMPT = {s.prompt: s for s in ALL_SCENES}
_WORD = re.compile(r"\w+")  # one character class, no alternation or nesting: a linear tokenizer
_KIND_OF_WORD = {
    **dict.fromkeys(COLORS, "color"),
    **dict.fromkeys(SHAPES, "shape"),
    **dict.fromkeys(PITCH_BINS, "pitch"),
    "start": "when",
    "end": "when",
}


def parse_prompt(prompt: str) -> Scene | None:
    """The scene a prompt asks for, or None if it is not a tiny-world prompt.

    On one line of the lower-cased prompt, these words in this order, with anything between them: a
    colour, a shape, a pitch followed by one space and "tone", and "start" or "end" (whole words:
    runs of word characters). Where a line names several, the first colour and the last of the others
    that still leave the rest in order are taken. Time linear in the prompt's length (the regex this
    replaces backtracked, cubically; tests/test_server_limits.py shows both accept the same).
    """
    for line in prompt.lower().split("\n"):
        scene = _scene_of_line(line)
        if scene is not None:
            return scene
    return None


def _scene_of_line(line: str) -> Scene | None:
    """The scene one line names: its last "start"/"end", the last "<pitch> tone" before it, the last
    shape before that and the first colour before the shape."""
    words = [(m.group(), m.start(), m.end()) for m in _WORD.finditer(line)]
    kinds = [_KIND_OF_WORD.get(w) for w, _, _ in words]
    when = _last(kinds, "when", len(words))
    if when is None:
        return None

    def toned(i: int) -> bool:  # "<pitch> tone", one space between
        return words[i + 1][0] == "tone" and words[i + 1][1] == words[i][2] + 1 and line[words[i][2]] == " "

    pitch = next((i for i in range(when - 2, -1, -1) if kinds[i] == "pitch" and toned(i)), None)
    shape = None if pitch is None else _last(kinds, "shape", pitch)
    color = None if shape is None else next((i for i in range(shape) if kinds[i] == "color"), None)
    if color is None or shape is None or pitch is None:
        return None
    timing = "early" if words[when][0] == "start" else "late"
    return Scene(words[color][0], words[shape][0], words[pitch][0], timing)


def _last(kinds: list[str | None], kind: str, before: int) -> int | None:
    """The index of the last word of `kind` before index `before`, if any."""
    return next((i for i in range(before - 1, -1, -1) if kinds[i] == kind), None)


def active_video_frames(when: str) -> list[int]:
    half = VIDEO_FRAMES // 2
    return list(range(half)) if when == "early" else list(range(half, VIDEO_FRAMES))


def active_audio_frames(when: str) -> list[int]:
    half = AUDIO_FRAMES // 2
    return list(range(half)) if when == "early" else list(range(half, AUDIO_FRAMES))


MIN_RADIUS, MAX_RADIUS = 3.0, 4.5


def shape_mask(shape: str, cy: float, cx: float, radius: float, size: int = VIDEO_SIZE) -> torch.Tensor:
    """[size, size] bool: the pixels a circle or square of `radius` centred at (cy, cx) covers."""
    yy, xx = torch.meshgrid(torch.arange(size) + 0.5, torch.arange(size) + 0.5, indexing="ij")
    if shape == "circle":
        return (yy - cy) ** 2 + (xx - cx) ** 2 <= radius**2
    return ((yy - cy).abs() <= radius * 0.85) & ((xx - cx).abs() <= radius * 0.85)


@functools.lru_cache(maxsize=2)
def all_shape_masks(size: int = VIDEO_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Every distinct mask the world draws, at every centre where the largest shape fits in the frame
    (a little wider than the centres `render_scene` picks): [M, size * size] bool, and each mask's
    index into SHAPES [M]."""
    masks: dict[bytes, tuple[torch.Tensor, int]] = {}
    margin = math.ceil(MAX_RADIUS) - 1
    for cy, cx in itertools.product(range(margin, size - margin), repeat=2):
        for radius in torch.linspace(MIN_RADIUS, MAX_RADIUS, 31).tolist():
            for kind, shape in enumerate(SHAPES):
                mask = shape_mask(shape, cy + 0.5, cx + 0.5, radius, size).flatten()
                masks.setdefault(mask.numpy().tobytes(), (mask, kind))
    return torch.stack([m for m, _ in masks.values()]), torch.tensor([k for _, k in masks.values()])


def render_scene(scene: Scene, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Video [F, 3, H, W] in [0, 1] and audio amplitudes [AUDIO_FRAMES, AUDIO_BINS] in [0, 1]."""
    video = torch.full((VIDEO_FRAMES, 3, VIDEO_SIZE, VIDEO_SIZE), BACKGROUND)
    cy, cx = (torch.randint(5, VIDEO_SIZE - 5, (2,), generator=gen) + 0.5).tolist()
    radius = MIN_RADIUS + (MAX_RADIUS - MIN_RADIUS) * torch.rand((), generator=gen).item()
    mask = shape_mask(scene.shape, cy, cx, radius)
    color = torch.tensor(COLORS[scene.color]).view(3, 1, 1)
    for f in active_video_frames(scene.when):
        video[f] = torch.where(mask, color, video[f])
    amps = torch.zeros(AUDIO_FRAMES, AUDIO_BINS)
    amps[active_audio_frames(scene.when), PITCH_BINS[scene.pitch]] = 1.0
    return video, amps


ATTRIBUTE_OPTIONS: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "pitch": tuple(PITCH_BINS),
    "when": tuple(WHEN_PHRASES),
}


def synthetic_clips(
    batch_size: int, gen: torch.Generator, label_noise: dict[str, float] | float = 0.0
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """Prompts, video [B, F, 3, H, W] and audio amplitudes [B, AUDIO_FRAMES, AUDIO_BINS] of random
    scenes.

    With probability `label_noise[attribute]` (one number: the same for every attribute) the clip's
    colour, shape, pitch or timing is redrawn at random, each independently of the prompt and of the
    others: a base model trained on such clips follows each attribute of a prompt only partly, which
    leaves post-training room on every attribute.
    """
    noise = label_noise if isinstance(label_noise, dict) else dict.fromkeys(ATTRIBUTE_OPTIONS, label_noise)
    unknown = sorted(set(noise) - set(ATTRIBUTE_OPTIONS))
    if unknown:
        raise ValueError(f"label_noise: unknown attributes {unknown}; use {', '.join(ATTRIBUTE_OPTIONS)}")
    prompts, videos, amps = [], [], []
    for _ in range(batch_size):
        scene = ALL_SCENES[int(torch.randint(len(ALL_SCENES), (1,), generator=gen))]
        shown = scene
        for attr, options in ATTRIBUTE_OPTIONS.items():
            if torch.rand((), generator=gen).item() < noise.get(attr, 0.0):
                pick = options[int(torch.randint(len(options), (1,), generator=gen))]
                shown = Scene(**{**shown.__dict__, attr: pick})
        v, a = render_scene(shown, gen)
        prompts.append(scene.prompt)
        videos.append(v)
        amps.append(a)
    return prompts, torch.stack(videos), torch.stack(amps)


def render_prompts(prompts: list[str], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The world's own clips of tiny-world prompts: video [B, F, 3, H, W] and waveform [B, 1, S], or
    None when a prompt is not a tiny-world prompt (then there is no reference to show)."""
    scenes = [parse_prompt(p) for p in prompts]
    if not scenes or any(s is None for s in scenes):
        return None
    rendered = [render_scene(s, gen) for s in scenes if s is not None]
    amps = torch.stack([a for _, a in rendered])
    return torch.stack([v for v, _ in rendered]), synthesize_audio(amps)
