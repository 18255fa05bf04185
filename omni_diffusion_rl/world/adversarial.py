"""Adversarial tiny-world clips: what a policy that games its rewards would make.

Each case takes the world's scene for a prompt and breaks it in one way a policy could find
cheaper than the real scene: flood the frame with the prompt's colour, play the tone for the whole
clip, keep picture and sound on all the time, noise, a blank clip, one attribute wrong, picture and
sound out of step, every sample of a prompt at the same spot. A reward whose score on any case
comes close to its score on the world's own clips can be gamed (`odrl probe-rewards` prints the
table; the tests assert it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import tiny_world as world

if TYPE_CHECKING:  # the world sits below the rewards: it only names the type
    from ..reward import WeightedReward

Clip = tuple[torch.Tensor, torch.Tensor]  # video [F, 3, H, W], amplitudes [AUDIO_FRAMES, AUDIO_BINS]


def _changed(scene: world.Scene, attribute: str) -> world.Scene:
    """The scene with `attribute` set to the next option (always a different one)."""
    options = world.ATTRIBUTE_OPTIONS[attribute]
    value = options[(options.index(getattr(scene, attribute)) + 1) % len(options)]
    return world.Scene(**{**scene.__dict__, attribute: value})


def _flooded(scene: world.Scene, gen: torch.Generator) -> Clip:
    video, amps = world.render_scene(scene, gen)
    color = torch.tensor(world.COLORS[scene.color]).view(3, 1, 1)
    for f in world.active_video_frames(scene.when):
        video[f] = color.expand_as(video[f])
    return video, amps


def _whole_clip_tone(scene: world.Scene, gen: torch.Generator) -> Clip:
    video, amps = world.render_scene(scene, gen)
    return video, amps.amax(0, keepdim=True).expand_as(amps).clone()


def _always_on(scene: world.Scene, gen: torch.Generator) -> Clip:
    video, amps = _whole_clip_tone(scene, gen)
    return video.amax(0, keepdim=True).expand_as(video).clone(), amps


def _noise(scene: world.Scene, gen: torch.Generator) -> Clip:
    shape = (world.VIDEO_FRAMES, 3, world.VIDEO_SIZE, world.VIDEO_SIZE)
    return torch.rand(shape, generator=gen), torch.rand(world.AUDIO_FRAMES, world.AUDIO_BINS, generator=gen)


def _blank(scene: world.Scene, gen: torch.Generator) -> Clip:
    shape = (world.VIDEO_FRAMES, 3, world.VIDEO_SIZE, world.VIDEO_SIZE)
    return torch.full(shape, world.BACKGROUND), torch.zeros(world.AUDIO_FRAMES, world.AUDIO_BINS)


def _out_of_step(scene: world.Scene, gen: torch.Generator) -> Clip:
    video, _ = world.render_scene(scene, gen)
    _, amps = world.render_scene(_changed(scene, "when"), gen)
    return video, amps


def _one_spot(scene: world.Scene, gen: torch.Generator) -> Clip:
    """The scene at the same place and size every time (a collapsed policy)."""
    return world.render_scene(scene, torch.Generator().manual_seed(world.ALL_SCENES.index(scene)))


def _wrong(attribute: str) -> Callable[[world.Scene, torch.Generator], Clip]:
    def make(scene: world.Scene, gen: torch.Generator) -> Clip:
        return world.render_scene(_changed(scene, attribute), gen)

    return make


CASES: dict[str, Callable[[world.Scene, torch.Generator], Clip]] = {
    "flooded_frame": _flooded,
    "tone_whole_clip": _whole_clip_tone,
    "always_on": _always_on,
    "noise": _noise,
    "blank": _blank,
    "picture_sound_out_of_step": _out_of_step,
    "one_spot_per_prompt": _one_spot,
    "wrong_color": _wrong("color"),
    "wrong_shape": _wrong("shape"),
    "wrong_pitch": _wrong("pitch"),
    "wrong_timing": _wrong("when"),
}


def clips(case: str, scenes: list[world.Scene], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Video [B, F, 3, H, W] and waveforms [B, 1, S] of `case` ('world' for the world's own clips)
    for each scene."""
    make = world.render_scene if case == "world" else CASES[case]
    gen = torch.Generator().manual_seed(seed)
    made = [make(s, gen) for s in scenes]
    video = torch.stack([v for v, _ in made])
    return video, world.synthesize_audio(torch.stack([a for _, a in made]))


def probe_rewards(reward: WeightedReward, seed: int = 0) -> dict[str, dict[str, float]]:
    """Mean score of every reward (and their weighted total) on the world's own clips of each scene
    (four each) and on each adversarial case: {reward: {case: mean}}, for `odrl probe-rewards`."""
    scenes = world.ALL_SCENES * 4  # four samples of each prompt, grouped by prompt as in training
    return probe_table(
        reward,
        [s.prompt for s in scenes],
        ["world", *CASES],
        lambda case: clips(case, scenes, seed),
        world.FPS,
        world.SAMPLE_RATE,
    )


def probe_table(
    reward: WeightedReward,
    prompts: list[str],
    cases: list[str],
    make: Callable[[str], tuple[torch.Tensor, torch.Tensor]],
    fps: float,
    sample_rate: int,
    judge: Callable[[torch.Tensor, torch.Tensor, list[str]], dict[str, torch.Tensor]] | None = None,
) -> dict[str, dict[str, float]]:
    """{column: {case: mean}}: `reward`'s total and parts (and `judge`'s columns) on the clips
    `make(case)` (video, waveforms) of every case, NaNs left out of the means."""
    from ..media import MediaBatch

    table: dict[str, dict[str, float]] = {}
    for case in cases:
        video, audio = make(case)
        media = MediaBatch(video=video, audio=audio, fps=fps, sample_rate=sample_rate)
        scored = reward(media, prompts, check=False)
        columns = {"total": scored.total, **{k: v for k, v in scored.parts.items() if "/" not in k}}
        columns |= judge(video, audio, prompts) if judge else {}
        for name, values in columns.items():
            finite = values[values.isfinite()]
            table.setdefault(name, {})[case] = float(finite.mean()) if len(finite) else float("nan")
    return table
