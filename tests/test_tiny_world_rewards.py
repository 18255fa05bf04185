"""The tiny world's training rewards and its judge: each against the world's own clips and against
adversarial clips (what a policy gaming its rewards would make)."""

from __future__ import annotations

import math

import pytest
import torch

from omni_diffusion_rl.config import ExperimentConfig
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import Registry
from omni_diffusion_rl.reward import RewardError, RewardOutput, WeightedReward
from omni_diffusion_rl.world import adversarial, judge
from omni_diffusion_rl.world import tiny_world as world

GROUP = "omni_diffusion_rl.rewards"
TINY_REWARDS = (
    "color_match",
    "shape_match",
    "pitch_match",
    "timing_match",
    "av_sync",
    "clean_background",
    "group_diversity",
)
DEFAULT_WEIGHTS = ExperimentConfig().reward.weights  # the default config's training reward
# Which adversarial cases each reward must score clearly below the world's own clip: the cases that
# break what it measures (a colour reward cannot see a wrong pitch).
BREAKS = {
    "color_match": ["flooded_frame", "noise", "blank", "wrong_color"],
    "shape_match": ["flooded_frame", "noise", "blank", "wrong_shape"],
    "pitch_match": ["noise", "blank", "wrong_pitch"],
    "timing_match": [
        "tone_whole_clip",
        "always_on",
        "noise",
        "blank",
        "picture_sound_out_of_step",
        "wrong_timing",
    ],
    "av_sync": ["tone_whole_clip", "always_on", "noise", "blank", "picture_sound_out_of_step"],
    "clean_background": ["flooded_frame", "noise"],
    "group_diversity": ["flooded_frame", "noise", "blank", "one_spot_per_prompt"],
}


def _media(case: str, scenes: list[world.Scene]) -> MediaBatch:
    video, audio = adversarial.clips(case, scenes)
    return MediaBatch(video=video, audio=audio, fps=world.FPS, sample_rate=world.SAMPLE_RATE)


def _reward(name: str):  # noqa: ANN202 - a reward plug-in instance
    return Registry("reward", GROUP).create(name)


@pytest.fixture(scope="module")
def scores() -> dict[str, dict[str, torch.Tensor]]:
    """case -> reward -> scores [288] over every scene of the world, 4 samples each."""
    scenes = world.ALL_SCENES * 4
    prompts = [s.prompt for s in scenes]
    out = {}
    for case in ["world", *adversarial.CASES]:
        media = _media(case, scenes)
        out[case] = {name: _reward(name).score(media, prompts) for name in TINY_REWARDS}
    return out


@pytest.mark.parametrize("name", TINY_REWARDS)
def test_every_reward_is_near_one_on_the_worlds_clips(name: str, scores: dict) -> None:
    values = scores["world"][name]
    assert values.shape == (4 * len(world.ALL_SCENES),)
    if name == "group_diversity":  # two of the world's own clips can land close together
        assert float(values.mean()) > 0.9 and float(values.quantile(0.1)) > 0.7
    else:
        assert float(values.min()) > 0.95, name
    assert float(values.max()) <= 1.0 + 1e-6


@pytest.mark.parametrize("name", TINY_REWARDS)
def test_every_reward_is_clearly_lower_on_the_cases_that_break_it(name: str, scores: dict) -> None:
    for case in BREAKS[name]:
        values = scores[case][name]
        assert torch.isfinite(values).all() and float(values.min()) >= 0, (name, case)
        assert float(values.mean()) < 0.55, f"{name} scores {case} at {float(values.mean()):.2f}"


@pytest.mark.parametrize("case", list(adversarial.CASES))
def test_the_training_reward_is_maximised_by_the_scene_only(case: str, scores: dict) -> None:
    """No adversarial clip comes near the world's own under the default weights, per scene."""

    def combined(per_reward: dict[str, torch.Tensor]) -> torch.Tensor:
        total = sum(DEFAULT_WEIGHTS.values())
        return sum(w * per_reward[n] for n, w in DEFAULT_WEIGHTS.items()) / total

    real, fake = combined(scores["world"]), combined(scores[case])
    assert float(real.mean()) > 0.97
    gap = float((real - fake).mean())
    assert gap > 0.05, f"{case} comes within {gap:.3f}"
    assert float(real.quantile(0.1)) > float(fake.quantile(0.9)) - 0.05 or gap > 0.15


def test_the_default_reward_covers_every_tiny_world_reward() -> None:
    assert set(DEFAULT_WEIGHTS) == set(TINY_REWARDS)


def test_right_color_in_the_wrong_shape_keeps_the_colour_but_loses_the_shape(scores: dict) -> None:
    assert float(scores["wrong_shape"]["color_match"].min()) > 0.95
    assert float(scores["wrong_shape"]["shape_match"].max()) < 0.2


# ---------------------------------------------------------------------------------------------------------
# The judge (evaluation only)


def _judged(case: str, scenes: list[world.Scene]) -> dict[str, torch.Tensor]:
    video, audio = adversarial.clips(case, scenes)
    return judge.judge_clips(video, audio, world.SAMPLE_RATE, [s.prompt for s in scenes])


def test_the_judge_passes_every_world_clip() -> None:
    decisions = _judged("world", world.ALL_SCENES * 2)
    for name in (*judge.ATTRIBUTES, "all_correct", "recognisable_shape", "clean_background"):
        assert float(decisions[name].min()) == 1.0, name
    assert float(decisions["sound_only_in_named_half"].min()) == 1.0
    for sign in ("flooded", "shape_in_both_halves", "silent"):
        assert float(decisions[sign].max()) == 0.0, sign
    assert float(decisions["diversity"].mean()) > 0.05  # every prompt appears twice, at random places


def test_the_picture_measures_grade_grain_that_every_yes_no_sign_lets_through() -> None:
    """Grain of 0.05 on every pixel (under the stray-pixel threshold): the attributes and health signs
    still pass, the picture measures do not; the world's own clips measure 0."""
    scenes = world.ALL_SCENES[:8]
    video, audio = adversarial.clips("world", scenes)
    clean = judge.judge_clips(video, audio, world.SAMPLE_RATE, [s.prompt for s in scenes])
    grain = 0.05 * torch.sign(torch.randn(video.shape, generator=torch.Generator().manual_seed(0)))
    grainy = judge.judge_clips(
        (video + grain).clamp(0, 1), audio, world.SAMPLE_RATE, [s.prompt for s in scenes]
    )
    for name in (*judge.ATTRIBUTES, "clean_background", "recognisable_shape"):
        assert float(clean[name].min()) == float(grainy[name].min()) == 1.0, name
    for measure in judge.PICTURE_MEASURES:
        assert float(clean[measure].max()) == 0.0, measure
        assert float(grainy[measure].min()) > 0.02, measure


@pytest.mark.parametrize(
    ("case", "wrong", "signs"),
    [
        ("flooded_frame", ["shape", "color"], {"flooded": 1.0, "recognisable_shape": 0.0}),
        ("tone_whole_clip", ["timing"], {"sound_only_in_named_half": 0.0}),
        ("always_on", ["timing"], {"shape_in_both_halves": 1.0}),
        ("noise", ["color", "shape", "pitch", "timing"], {"clean_background": 0.0}),
        ("blank", ["color", "shape", "pitch", "timing"], {"silent": 1.0, "recognisable_shape": 0.0}),
        ("wrong_color", ["color"], {}),
        ("wrong_shape", ["shape"], {"recognisable_shape": 1.0}),
        ("wrong_pitch", ["pitch"], {}),
        ("wrong_timing", ["timing"], {}),
        ("picture_sound_out_of_step", ["timing"], {}),
    ],
)
def test_the_judge_fails_exactly_what_each_case_breaks(case: str, wrong: list[str], signs: dict) -> None:
    decisions = _judged(case, world.ALL_SCENES)
    assert float(decisions["all_correct"].max()) == 0.0
    for attribute in judge.ATTRIBUTES:
        expected = 0.0 if attribute in wrong else 1.0
        assert float(decisions[attribute].mean()) == expected, (case, attribute)
    for sign, value in signs.items():
        assert float(decisions[sign].mean()) == value, (case, sign)


def test_judge_scorer_reports_all_correct_with_components() -> None:
    scorer = _reward("tiny_world_judge")
    media = _media("world", world.ALL_SCENES[:4])
    out = scorer.score(media, [s.prompt for s in world.ALL_SCENES[:4]])
    assert isinstance(out, RewardOutput)
    assert out.scores.tolist() == [1.0] * 4
    assert set(out.components) == {*judge.ATTRIBUTES, *judge.HEALTH, "diversity", *judge.PICTURE_MEASURES}
    assert scorer.headline == "all_correct"
    assert math.isnan(float(out.components["diversity"][0]))  # each prompt once: no group to compare


# ---------------------------------------------------------------------------------------------------------
# Contract details


def test_silent_or_empty_media_scores_zero_not_nan() -> None:
    media = _media("blank", world.ALL_SCENES[:1])
    prompt = [world.ALL_SCENES[0].prompt]
    for name in TINY_REWARDS:
        if name in ("clean_background", "group_diversity"):
            continue  # an empty background is clean; a lone sample has no group (tested below)
        score = _reward(name).score(media, prompt)
        assert torch.isfinite(score).all(), name
        assert float(score[0]) == pytest.approx(0.0, abs=1e-6), name


@pytest.mark.parametrize("name", [*TINY_REWARDS, "tiny_world_judge"])
def test_non_tiny_world_prompt_raises(name: str) -> None:
    media = _media("world", world.ALL_SCENES[:1] * 2)
    with pytest.raises(ValueError, match="not a tiny-world prompt"):
        _reward(name).score(media, ["a photo of a cat"] * 2)
    combined = WeightedReward({name: _reward(name)}, {name: 1.0})
    with pytest.raises(RewardError, match=f"{name}: ValueError.*not a tiny-world prompt"):
        combined(media, ["a photo of a cat"] * 2)


def test_group_diversity_needs_the_other_samples_of_a_prompt() -> None:
    scenes = [world.ALL_SCENES[0], world.ALL_SCENES[0], world.ALL_SCENES[1]]
    media = _media("world", scenes)
    scores = _reward("group_diversity").score(media, [s.prompt for s in scenes])
    assert torch.isfinite(scores[:2]).all() and torch.isnan(scores[2])
    combined = WeightedReward({"group_diversity": _reward("group_diversity")}, {"group_diversity": 1.0})
    result = combined(media, [s.prompt for s in scenes], check=False)
    assert set(result.failures) == {2} and "non-finite" in result.failures[2]


def test_rewards_need_their_modality() -> None:
    audio_only = MediaBatch(audio=torch.zeros(1, 1, 4000), sample_rate=world.SAMPLE_RATE)
    prompt = [world.ALL_SCENES[0].prompt]
    for name in ("color_match", "shape_match", "clean_background", "timing_match", "av_sync"):
        with pytest.raises(ValueError, match="video"):
            _reward(name).score(audio_only, prompt)
    video_only = MediaBatch(video=torch.zeros(1, 4, 3, 16, 16))
    for name in ("pitch_match", "timing_match", "av_sync"):
        with pytest.raises(ValueError, match="audio"):
            _reward(name).score(video_only, prompt)
