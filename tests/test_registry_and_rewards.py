"""Plug-in registries, the weighted reward and its failure rules, and the four tiny-world detectors."""

from __future__ import annotations

import asyncio
from importlib.metadata import entry_points

import pytest
import torch

import omni_diffusion_rl.reward as reward_module
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import Registry, RegistryError
from omni_diffusion_rl.reward import RewardError, RewardOutput, WeightedReward, checked_output
from omni_diffusion_rl.world import adversarial
from omni_diffusion_rl.world import tiny_world as world

TINY_REWARDS = ("av_sync", "clean_background", "color_match", "pitch_match", "shape_match", "timing_match")
GROUP = "omni_diffusion_rl.rewards"

# ---------------------------------------------------------------------------------------------------------
# Registry


def _empty_registry() -> Registry:
    return Registry("widget", "omni_diffusion_rl.tests_no_such_group")


def test_register_get_create() -> None:
    widgets = _empty_registry()

    @widgets.register("box")
    class Box:
        def __init__(self, size: int = 1) -> None:
            self.size = size

    assert Box.__name__ == "Box"  # the decorator returns the class itself
    assert widgets.get("box") is Box
    made = widgets.create("box", size=3)
    assert isinstance(made, Box) and made.size == 3
    assert widgets.names() == ["box"]


def test_register_twice_needs_overwrite() -> None:
    widgets = _empty_registry()

    def first() -> int:
        return 1

    def second() -> int:
        return 2

    widgets.register("f")(first)
    widgets.register("f")(first)  # the same factory again is harmless
    with pytest.raises(RegistryError, match="already registered") as info:
        widgets.register("f")(second)
    assert "first" in str(info.value) and "overwrite=True" in str(info.value)
    assert widgets.create("f") == 1
    widgets.register("f", overwrite=True)(second)
    assert widgets.create("f") == 2


def test_unknown_name_lists_registered_names() -> None:
    widgets = _empty_registry()
    widgets.register("alpha")(dict)
    widgets.register("beta")(list)
    with pytest.raises(RegistryError) as info:
        widgets.get("gamma")
    message = str(info.value)
    assert message.startswith("unknown widget 'gamma'")  # not quoted like a plain KeyError
    assert "alpha, beta" in message
    assert "omni_diffusion_rl.tests_no_such_group" in message
    assert isinstance(info.value, KeyError)
    with pytest.raises(RegistryError, match=r"\(none\)"):
        _empty_registry().create("anything")


def test_tiny_world_rewards_are_installed_entry_points() -> None:
    found = {ep.name: ep for ep in entry_points(group=GROUP)}
    assert set(TINY_REWARDS) <= set(found)
    for name in TINY_REWARDS:
        assert found[name].value.startswith("rewards.tiny_world:")
    # A fresh registry finds them through the entry points alone and loads them lazily.
    fresh = Registry("reward", GROUP)
    assert set(TINY_REWARDS) <= set(fresh.names())
    color = fresh.get("color_match")
    assert color.__name__ == "ColorMatchReward"
    assert hasattr(fresh.create("pitch_match"), "score")
    assert fresh.get("color_match") is color


def test_global_reward_registry_resolves_tiny_world_names() -> None:
    from omni_diffusion_rl.registry import rewards

    for name in TINY_REWARDS:
        assert callable(getattr(rewards.create(name), "score", None))


# ---------------------------------------------------------------------------------------------------------
# Weighted reward and the failure rules


class _Constant:
    def __init__(self, value: float) -> None:
        self.value = value

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        return torch.full((len(media),), self.value)


def _audio_media(batch: int = 3) -> MediaBatch:
    return MediaBatch(audio=torch.zeros(batch, 1, 16))


def test_weighted_reward_normalises_weights_and_keeps_components() -> None:
    combined = WeightedReward({"a": _Constant(1.0), "b": _Constant(0.2)}, {"a": 3.0, "b": 1.0})
    assert combined.weights == pytest.approx({"a": 0.75, "b": 0.25})
    result = combined(_audio_media(), ["p"] * 3)
    assert result.total.tolist() == pytest.approx([0.75 * 1.0 + 0.25 * 0.2] * 3)
    assert set(result.parts) == {"a", "b"}
    assert result.parts["a"].tolist() == [1.0] * 3
    assert result.parts["b"].tolist() == pytest.approx([0.2] * 3)
    assert result.failures == {} and result.ok.all()


def test_weighted_reward_zero_weight_component_is_still_scored() -> None:
    combined = WeightedReward({"a": _Constant(1.0), "b": _Constant(0.0)}, {"a": 1.0, "b": 0.0})
    result = combined(_audio_media(2), ["p", "q"])
    assert result.total.tolist() == [1.0, 1.0]
    assert result.parts["b"].tolist() == [0.0, 0.0]


def test_weighted_reward_rejects_bad_setups() -> None:
    with pytest.raises(ValueError, match="same rewards"):
        WeightedReward({"a": _Constant(1.0)}, {"b": 1.0})
    with pytest.raises(ValueError, match="positive"):
        WeightedReward({"a": _Constant(1.0)}, {"a": 0.0})
    combined = WeightedReward({"a": _Constant(1.0)}, {"a": 1.0})
    with pytest.raises(RewardError, match="2 prompts for 3"):
        combined(_audio_media(3), ["p", "q"])


class _WithComponents:
    def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        n = len(media)
        return RewardOutput(torch.full((n,), 0.5), {"x": torch.arange(n).float(), "y": torch.ones(n)})


class _Async:
    async def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        await asyncio.sleep(0)
        return torch.tensor([float(len(p)) for p in prompts])


def test_components_and_async_rewards_are_combined() -> None:
    combined = WeightedReward({"c": _WithComponents(), "n": _Async()}, {"c": 1.0, "n": 1.0})
    result = combined(_audio_media(2), ["ab", "abcd"])
    assert result.total.tolist() == pytest.approx([(0.5 + 2) / 2, (0.5 + 4) / 2])
    assert result.parts["c/x"].tolist() == [0.0, 1.0] and result.parts["c/y"].tolist() == [1.0, 1.0]
    assert result.parts["n"].tolist() == [2.0, 4.0]
    assert combined.submit(_audio_media(2), ["ab", "abcd"]).result().total.tolist() == result.total.tolist()
    combined.close()


class _FailsOn:
    """Raises (or gives NaN) whenever the batch holds a prompt in `bad`; counts its calls."""

    def __init__(self, bad: set[str], how: str = "raise", times: int = 10**9) -> None:
        self.bad, self.how, self.times, self.calls = bad, how, times, 0

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        self.calls += 1
        hit = [p in self.bad for p in prompts]
        if any(hit) and self.calls <= self.times:
            if self.how == "raise":
                raise OSError(f"cannot read {sorted(self.bad)}")
            return torch.tensor([float("nan") if h else 1.0 for h in hit])
        return torch.ones(len(prompts))


def test_a_sample_that_keeps_failing_is_dropped_with_its_reason_not_scored_zero() -> None:
    prompts = ["a", "b", "bad", "c", "d"]
    for how, reason in [("raise", "OSError: cannot read ['bad']"), ("nan", "non-finite")]:
        flaky = _FailsOn({"bad"}, how)
        result = WeightedReward({"f": flaky, "one": _Constant(1.0)}, {"f": 1.0, "one": 1.0}, retries=2)(
            _audio_media(5), prompts
        )
        assert list(result.failures) == [2] and reason in result.failures[2] and "f:" in result.failures[2]
        assert result.ok.tolist() == [True, True, False, True, True]
        assert torch.isnan(result.total[2]) and torch.isnan(result.parts["one"][2])
        assert result.total[[0, 1, 3, 4]].tolist() == [1.0] * 4


def test_a_transient_failure_is_retried_and_scores_everything() -> None:
    for how in ("raise", "nan"):
        flaky = _FailsOn({"b"}, how, times=1)
        result = WeightedReward({"f": flaky}, {"f": 1.0}, retries=1)(_audio_media(3), ["a", "b", "c"])
        assert result.failures == {} and result.total.tolist() == [1.0, 1.0, 1.0]
        assert flaky.calls == 2


def test_too_many_failed_samples_stop_with_the_reasons() -> None:
    combined = WeightedReward({"f": _FailsOn({"x"})}, {"f": 1.0}, retries=0, max_failed_fraction=0.25)
    with pytest.raises(RewardError, match=r"2 of 4 samples could not be scored.*OSError"):
        combined(_audio_media(4), ["x", "x", "a", "b"])


class _Broken:
    def __init__(self, kind: str) -> None:
        self.kind = kind

    def score(self, media: MediaBatch, prompts: list[str]) -> object:
        n = len(media)
        if self.kind == "nan":
            return torch.tensor([0.5] + [float("nan")] * (n - 1))
        if self.kind == "inf":
            return torch.full((n,), float("inf"))
        if self.kind == "shape":
            return torch.zeros(n, 2)
        if self.kind == "list":
            return [0.5] * n
        raise OSError("model weights not found")


@pytest.mark.parametrize(
    ("kind", "fragment"),
    [
        ("nan", "non-finite"),
        ("inf", "non-finite"),
        ("shape", "shape (3, 2)"),
        ("list", "torch.Tensor"),
        ("raise", "OSError: model weights not found"),
    ],
)
def test_registered_broken_reward_is_an_error_naming_it(
    kind: str, fragment: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = Registry("reward", GROUP)
    registry.register("broken_reward")(lambda: _Broken(kind))
    monkeypatch.setattr(reward_module, "reward_registry", registry)
    combined = WeightedReward.from_registry({"pitch_match": 1.0, "broken_reward": 1.0})
    video, audio = adversarial.clips("world", [world.ALL_SCENES[0]] * 3)
    media = MediaBatch(video=video, audio=audio, fps=world.FPS, sample_rate=world.SAMPLE_RATE)
    prompts = [world.ALL_SCENES[0].prompt] * 3
    with pytest.raises(RewardError) as info:
        combined(media, prompts)
    assert "broken_reward" in str(info.value)
    assert fragment in str(info.value)


def test_reward_error_from_a_component_passes_through_unchanged() -> None:
    class Strict:
        def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
            raise RewardError("strict says no")

    with pytest.raises(RewardError, match="^strict says no$"):
        WeightedReward({"strict": Strict()}, {"strict": 1.0})(_audio_media(1), ["p"])


def test_checked_output_converts_to_float_cpu() -> None:
    out = checked_output("x", torch.tensor([1, 0], dtype=torch.int64), 2).scores
    assert out.dtype == torch.float32 and out.tolist() == [1.0, 0.0]
    with pytest.raises(RewardError, match=r"'x'.*expected \(3,\)"):
        checked_output("x", torch.zeros(2), 3)
