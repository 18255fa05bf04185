"""The reward contract and the weighted combination the trainer uses.

A reward is any object with `score(media: MediaBatch, prompts: list[str]) -> Tensor[B]` whose
scores are finite; register it with `@omni_diffusion_rl.registry.rewards.register("name")`.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from .media import MediaBatch
from .registry import rewards as reward_registry


class RewardError(RuntimeError):
    """A reward failed or returned something unusable; never scored as 0."""


@runtime_checkable
class Reward(Protocol):
    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor: ...


def checked_scores(name: str, scores: object, batch_size: int) -> torch.Tensor:
    """The scores as a float tensor [B], or a RewardError naming what is wrong."""
    if not isinstance(scores, torch.Tensor):
        raise RewardError(
            f"reward '{name}' returned {type(scores).__name__}; it must return a torch.Tensor [B]"
        )
    if scores.shape != (batch_size,):
        raise RewardError(
            f"reward '{name}' returned shape {tuple(scores.shape)} for a batch of {batch_size}; "
            f"expected ({batch_size},)"
        )
    bad = ~torch.isfinite(scores)
    if bad.any():
        raise RewardError(
            f"reward '{name}' returned non-finite scores (NaN/inf) for samples "
            f"{bad.nonzero().flatten().tolist()}"
        )
    return scores.detach().float().cpu()


class WeightedReward:
    """sum_i w_i * reward_i / sum_i w_i, with every component kept for logging."""

    def __init__(self, components: dict[str, Reward], weights: dict[str, float]) -> None:
        if set(components) != set(weights):
            raise ValueError(
                f"components {sorted(components)} and weights {sorted(weights)} must name the same rewards"
            )
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("reward weights must sum to a positive number")
        self.components = components
        self.weights = {k: w / total for k, w in weights.items()}

    @classmethod
    def from_registry(
        cls, weights: dict[str, float], options: dict[str, dict[str, Any]] | None = None
    ) -> WeightedReward:
        """Each named reward created from the registry with its keyword arguments from `options`."""
        options = options or {}
        return cls({name: reward_registry.create(name, **options.get(name, {})) for name in weights}, weights)

    def __call__(self, media: MediaBatch, prompts: list[str]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Combined scores [B] and each component's scores."""
        if len(prompts) != len(media):
            raise RewardError(f"{len(prompts)} prompts for {len(media)} media samples")
        parts = {}
        for name, reward in self.components.items():
            try:
                raw = reward.score(media, prompts)
            except RewardError:
                raise
            except Exception as e:
                raise RewardError(f"reward '{name}' failed: {type(e).__name__}: {e}") from e
            parts[name] = checked_scores(name, raw, len(media))
        total = sum(self.weights[name] * s for name, s in parts.items())
        return total, parts
