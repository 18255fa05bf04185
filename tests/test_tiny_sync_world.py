"""The tiny sync world (world/tiny_sync.py), its clip format (world/sync_clip.py) and its judge
(world/sync_judge.py): the world's own clips are right on every fact, and the judge sees what is
wrong in clips made wrong on purpose."""

from __future__ import annotations

import random

import pytest
import torch

from omni_diffusion_rl.world import sync_clip as clip
from omni_diffusion_rl.world import sync_judge as judge
from omni_diffusion_rl.world import tiny_sync as world

from .helpers import shifted_wave


def _clips(scenes: list[world.SyncScene]) -> tuple[torch.Tensor, torch.Tensor]:
    video = torch.stack([world.render_video(s) for s in scenes])
    return video, world.render_audio(torch.stack([world.render_envelope(s) for s in scenes]))


def _scenes(count: int, seed: int, second_object: float = 0.3) -> list[world.SyncScene]:
    rng = random.Random(seed)
    return [world.random_scene(rng, second_object=second_object) for _ in range(count)]


def test_a_scene_decodes_to_its_objects_touching_the_floor_on_their_strikes() -> None:
    scene = world.SyncScene(
        (world.Bouncer("blue", "large", 2, (3, 9)), world.Bouncer("red", "small", 10, (6,)))
    )
    q = clip.decoded_quantities(world.encode_scene(scene)[None])
    assert q["side"][0].tolist() == pytest.approx([5.0, 3.0])
    assert q["column"][0].tolist() == pytest.approx([2.0, 10.0])
    heights = q["height"][0]
    assert heights[0, [3, 9]].tolist() == [0.0, 0.0] and heights[1, 6] == 0.0
    assert bool((heights[0, [2, 4, 8, 10]] == 2.0).all()), "2 pixels in the frame before and after a strike"
    frames = world.render_video(scene)
    assert frames.shape == (clip.FRAMES, 3, clip.SIZE, clip.SIZE)
    blue = torch.tensor(world.COLORS["blue"])
    assert torch.allclose(frames[3, :, clip.SIZE - 1, 2:7], blue[:, None].expand(3, 5))


def test_three_objects_do_not_fit_and_bad_strikes_are_refused() -> None:
    one = world.Bouncer("red", "small", 1, (3,))
    with pytest.raises(ValueError, match="at most 2 objects"):
        world.encode_scene(world.SyncScene((one, one, one)))
    with pytest.raises(ValueError, match="4\\+ frames apart"):
        world.Bouncer("red", "small", 1, (3, 5))
    with pytest.raises(ValueError, match="unknown object"):
        world.Bouncer("pink", "small", 1, (3,))


def test_the_judge_finds_every_fact_right_in_the_worlds_own_clips() -> None:
    scenes = _scenes(120, seed=0)
    video, audio = _clips(scenes)
    verdict = judge.judge_clips(video, audio, [s.prompt for s in scenes])
    assert bool((verdict["all_correct"] == 1).all())
    assert float(verdict["abs_offset_frames"].max()) < 0.05
    assert not bool(verdict["flooded"].any() or verdict["noisy"].any() or verdict["frozen"].any())


@pytest.mark.parametrize("k", [-3, -2, 2, 3])
def test_sound_moved_by_k_frames_is_out_of_sync_by_k(k: int) -> None:
    scenes = [
        s
        for s in _scenes(60, seed=k, second_object=0.0)
        if all(0 < t + k < clip.FRAMES - 1 for t in s.objects[0].strikes)
    ]
    video, audio = _clips(scenes)
    moved = shifted_wave(audio, k * clip.SAMPLE_RATE // int(clip.FPS))
    verdict = judge.judge_clips(video, moved, [s.prompt for s in scenes])
    assert not bool(verdict["in_sync"].any()) and not bool(verdict["all_correct"].any())
    assert verdict["abs_offset_frames"].tolist() == pytest.approx([abs(k)] * len(scenes), abs=0.05)
    assert bool((verdict["count"] == 1).all()), "moved, not dropped"


def test_a_miscounted_or_miscoloured_clip_is_judged_wrong_on_that_fact_only() -> None:
    drawn = world.SyncScene((world.Bouncer("green", "small", 4, (3, 8)),))
    video, audio = _clips([drawn])
    asked_three = "a small green square bounces three times with a clink"
    verdict = judge.judge_clip(video[0], audio[0, 0], asked_three)
    assert verdict["count"] == 0 and verdict["color"] == verdict["size"] == verdict["in_sync"] == 1
    asked_red = "a small red square bounces twice with a low thud"
    verdict = judge.judge_clip(video[0], audio[0, 0], asked_red)
    assert verdict["color"] == 0 and verdict["all_correct"] == 0
    asked_large = "a large green square bounces twice with a clink"
    assert judge.judge_clip(video[0], audio[0, 0], asked_large)["size"] == 0


def test_prompts_parse_in_every_wording_and_the_held_out_split_is_apart() -> None:
    assert not set(world.TRAIN_PROMPTS) & set(world.HELDOUT_PROMPTS)
    trained = {(o.color, o.size, o.count) for p in world.TRAIN_PROMPTS for o in world.parse_prompt(p)}
    assert not trained & world.HELD_OUT_COMBINATIONS
    assert len(world.HELDOUT_PROMPTS) == 16
    scene = world.SyncScene((world.Bouncer("yellow", "large", 1, (3, 8, 12)),))
    for variant in range(2):
        assert world.parse_prompt(world.paraphrase(scene, variant)) == [
            world.ObjectSpec("yellow", "large", 3)
        ]
    assert world.parse_prompt("a big red square hits the floor thrice") == [
        world.ObjectSpec("red", "large", 3)
    ]
    with pytest.raises(ValueError, match="one colour"):
        world.parse_prompt("a square bounces twice")


def test_two_objects_of_a_scene_never_overlap() -> None:
    for scene in _scenes(200, seed=5, second_object=1.0):
        left, right = scene.objects
        assert left.column + world.SIZES[left.size] <= right.column
        assert right.column + world.SIZES[right.size] <= clip.SIZE


def test_two_objects_never_strike_within_pair_gap_frames_of_each_other() -> None:
    """Every strike is a sound of its own: random scenes, and the pairs of counts that barely fit
    (three and three), keep PAIR_GAP frames between the objects' strikes, each object's count kept."""
    for scene in _scenes(200, seed=6, second_object=1.0):
        left, right = scene.objects
        assert min(abs(a - b) for a in left.strikes for b in right.strikes) >= world.PAIR_GAP
    first, second = world.strike_options(3)[0], world.strike_options(3)[0]
    moved = world.apart_strikes(first, second)
    assert [len(m) for m in moved] == [3, 3]
    assert min(abs(a - b) for a in moved[0] for b in moved[1]) >= world.PAIR_GAP
    assert world.apart_strikes((3,), (9,)) == ((3,), (9,))  # drawn apart already: kept


def test_the_base_noise_moves_the_sound_and_flips_counts() -> None:
    """The base's training clips (BaseNoise): as drawn they are out of sync and miscounted about as
    much as the base must start (median offset about 2 frames, few strikes matched, counts right
    together about a fifth of the time), and the objects stay right."""
    prompts, latents = world.training_batch(random.Random(0), 300, world.BaseNoise())
    verdict = judge.judge_clips(
        clip.decode_video(latents), clip.synthesize_sync(clip.decode_amps(latents)), prompts
    )
    assert float(verdict["color"].mean()) == 1.0 and float(verdict["size"].mean()) == 1.0
    assert float(verdict["abs_offset_frames"].nanmedian()) >= 1.75
    assert float(verdict["matched_share"].mean()) <= 0.3
    assert float(verdict["count"].mean()) <= 0.35


def test_fillers_keep_every_prompt_word_in_order_within_the_window_and_mean_nothing() -> None:
    """The base's filler words: the prompt's own words stay, in order; the whole fits the window;
    no filler is a word of either wording, or hashes to one at the model's vocabulary."""
    import re
    import zlib

    rng = random.Random(3)
    words = lambda text: re.findall(r"[a-z0-9]+", text.lower())  # noqa: E731 - the tokenizer's split
    lengths = set()
    for prompt in world.TRAIN_PROMPTS[:40]:
        filled = world.with_fillers(rng, prompt, 8, 32)
        added = [w for w in words(filled) if w in world.FILLER_WORDS]
        assert [w for w in words(filled) if w not in world.FILLER_WORDS] == words(prompt)
        assert len(added) <= 8 and len(words(filled)) <= 32
        lengths.add(len(added))
    assert len(lengths) >= 5, "filler counts are drawn, not fixed"
    vocabulary = {w for p in world.TRAIN_PROMPTS + world.HELDOUT_PROMPTS for w in words(p)}
    vocabulary |= {w for names in world.SIZE_WORDS.values() for w in names}
    vocabulary |= {w for phrases in world.COUNT_PHRASES.values() for p in phrases for w in p.split()}
    vocabulary |= {w for template in world.PARAPHRASES for w in words(template)}
    hashed = lambda w: 1 + zlib.crc32(w.encode()) % 1023  # noqa: E731 - the tiny model's vocab_size 1024
    assert not set(world.FILLER_WORDS) & vocabulary
    assert not {hashed(w) for w in world.FILLER_WORDS} & {hashed(w) for w in vocabulary}
