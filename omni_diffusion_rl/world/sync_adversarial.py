"""Clips of the tiny sync world that a policy gaming the sync rewards would make.

Each case takes the world's scene for a prompt and breaks it in one way the tiny sync model can
produce (an edit of the clip's latent: heights per frame, loudness per envelope frame): a glide with
a steady tone, a sound on every frame, the right count out of sync, the sound moved by three frames,
one strike too many (in sync), a still picture under the right sounds, silence. `wrong_color` is
not gaming: the sync rewards do not read colour, and the table shows that only the judge does.
`odrl probe-rewards` on a tiny_sync config prints the table; the tests assert that every gaming case
scores below the world's own clips.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from . import sync_judge as judge
from . import tiny_sync as world
from .adversarial import probe_table
from .sync_clip import FRAMES, PARTS, SLOT_DIM, SLOTS, decode_amps, decode_video, from_unit

if TYPE_CHECKING:  # the world sits below the rewards: it only names the type
    from ..reward import WeightedReward

NOT_GAMING = ("wrong_color",)
"""Cases the sync rewards are not meant to catch (they read timing, not looks): the judge does."""


def _slots(scene: world.SyncScene) -> torch.Tensor:
    return world.encode_scene(scene).view(SLOTS, SLOT_DIM).clone()


def _set(slot: torch.Tensor, part: str, quantity: torch.Tensor) -> None:
    start, length = PARTS[part]
    slot[start : start + length] = from_unit(quantity)


def _each_object(
    edit: Callable[[torch.Tensor, world.Bouncer, random.Random], None],
) -> Callable[[world.SyncScene, random.Random], torch.Tensor]:
    def make(scene: world.SyncScene, rng: random.Random) -> torch.Tensor:
        slots = _slots(scene)
        for slot, obj in zip(slots, scene.objects, strict=False):
            edit(slot, obj, rng)
        return slots.flatten()

    return make


def _glide_steady_tone(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    _set(slot, "height", torch.linspace(0, 1, FRAMES))  # rising at one speed: motion, no strike
    _set(slot, "loudness", torch.ones(world.AUDIO_FRAMES))


def _sound_every_frame(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    _set(slot, "loudness", world.loudness_of(tuple(range(1, FRAMES))))


def _right_count_out_of_sync(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    """Its strikes' sounds on another allowed set of frames, each 2 or more frames from every strike
    seen (the count heard right, none in sync); moved by 3 frames where no such set exists."""
    apart = [
        s for s in world.strike_options(obj.count) if all(abs(h - v) >= 2 for h in s for v in obj.strikes)
    ]
    heard = rng.choice(apart) if apart else tuple(min(s + 3, FRAMES - 2) for s in obj.strikes)
    _set(slot, "loudness", world.loudness_of(heard))


def _sound_three_frames_late(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    _set(slot, "loudness", world.loudness_of(tuple(min(s + 3, FRAMES - 1) for s in obj.strikes)))


def _one_strike_too_many(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    """Seen and heard together, in sync, one strike more (one fewer for three)."""
    count = obj.count + 1 if obj.count < max(world.COUNT_WORDS) else obj.count - 1
    options = [
        s for s in world.strike_options(count) if set(s) >= set(obj.strikes) or set(s) <= set(obj.strikes)
    ]
    strikes = rng.choice(options or list(world.strike_options(count)))
    _set(slot, "height", world.height_of(world.Bouncer(obj.color, obj.size, obj.column, strikes)))
    _set(slot, "loudness", world.loudness_of(strikes))


def _still_picture(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    _set(slot, "height", torch.full((FRAMES,), 0.25))  # hovering, never moving; the sounds stay


def _silent(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    _set(slot, "loudness", torch.zeros(world.AUDIO_FRAMES))


def _wrong_color(slot: torch.Tensor, obj: world.Bouncer, rng: random.Random) -> None:
    colors = list(world.COLORS)
    _set(slot, "color", torch.tensor(world.COLORS[colors[(colors.index(obj.color) + 1) % len(colors)]]))


CASES: dict[str, Callable[[world.SyncScene, random.Random], torch.Tensor]] = {
    "glide_with_steady_tone": _each_object(_glide_steady_tone),
    "sound_every_frame": _each_object(_sound_every_frame),
    "right_count_out_of_sync": _each_object(_right_count_out_of_sync),
    "sound_three_frames_late": _each_object(_sound_three_frames_late),
    "one_strike_too_many": _each_object(_one_strike_too_many),
    "still_picture": _each_object(_still_picture),
    "silent": _each_object(_silent),
    "wrong_color": _each_object(_wrong_color),
}


def probe_scenes(count: int = 48, seed: int = 0) -> list[world.SyncScene]:
    """Scenes of the training split, about half of them with two objects, two of each prompt (drawn
    apart, as a group of a batch is): rewards that compare a prompt's samples can score them."""
    rng = random.Random(seed)
    scenes = []
    while len(scenes) < count:
        scene = world.random_scene(rng, second_object=0.5)
        scenes += [scene, world.another_draw(rng, scene)][: count - len(scenes)]
    return scenes


def clips(case: str, scenes: list[world.SyncScene], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Video [B, FRAMES, 3, SIZE, SIZE] and waveforms [B, 1, S] of `case` ('world' for the world's
    own clips) for each scene."""
    rng = random.Random(seed)
    latents = torch.stack([world.encode_scene(s) if case == "world" else CASES[case](s, rng) for s in scenes])
    return decode_video(latents), world.render_audio(decode_amps(latents))


def probe_rewards(reward: WeightedReward, seed: int = 0, count: int = 48) -> dict[str, dict[str, float]]:
    """Mean score of every reward (and their weighted total) and the judge's every-fact-right share on
    the world's own clips of `count` scenes and on each case: {reward: {case: mean}}, for
    `odrl probe-rewards`."""
    scenes = probe_scenes(count)

    def judged(video: torch.Tensor, audio: torch.Tensor, prompts: list[str]) -> dict[str, torch.Tensor]:
        return {"judge: every fact right": judge.judge_clips(video, audio, prompts)["all_correct"]}

    return probe_table(
        reward,
        [s.prompt for s in scenes],
        ["world", *CASES],
        lambda case: clips(case, scenes, seed),
        world.FPS,
        world.SAMPLE_RATE,
        judged,
    )
