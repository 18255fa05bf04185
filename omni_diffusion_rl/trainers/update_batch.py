"""What an algorithm's update learns from: one step's scored experience (`UpdateBatch`). Its own
module, so that execution modes and the planner can hand an update its batch without importing an
algorithm."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..algorithms.advantages import group_advantages, per_reward_advantages
from ..algorithms.credit import modality_routes
from ..experience.rollout import Rollout
from ..reward import WeightedReward


@dataclass(frozen=True)
class UpdateBatch:
    """One step's experience as an update sees it: rewards, prompt groups and the trainable mask
    over every process ([N] each, in rank order), this process's samples (`rollout`, rows `local`
    of the N; a TextRollout for an algorithm that trains answers) and the step (counted from 0).
    `parts` holds each reward's own scores [N] and `weights` its weight, for per-reward advantages;
    `modalities` what each reward judges (video, audio, audio_video), for per-modality credit."""

    rollout: Rollout
    rewards: torch.Tensor
    groups: torch.Tensor
    keep: torch.Tensor
    local: slice
    step: int
    parts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)
    modalities: Mapping[str, str | None] = field(default_factory=dict)

    @classmethod
    def scored(
        cls,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
        parts: Mapping[str, torch.Tensor],
        reward: WeightedReward,
    ) -> UpdateBatch:
        """The batch of a step scored by `reward`: its weighted rewards' own scores (from `parts`, which
        also holds their components), weights and judged modalities ride along."""
        weights = reward.weights
        own = {name: parts[name] for name in weights if name in parts}
        return cls(rollout, rewards, groups, keep, local, step, own, weights, reward.modalities)

    @property
    def mine(self) -> torch.Tensor:
        """[n] bool: which of this process's samples are trainable."""
        return self.keep[self.local]

    def advantages(
        self,
        per_group_std: bool = False,
        std_correction: int = 0,
        per_reward: bool = False,
        rewards: Sequence[str] | None = None,
    ) -> torch.Tensor:
        """[N] group-relative advantages of the trainable samples over the whole step (0 for the
        others); per_reward: each reward normalised on its own, then summed with its weight.
        rewards: only these rewards' weighted scores count (None: the step's combined reward)."""
        adv = torch.zeros(len(self.rewards))
        groups = self.groups[self.keep]
        if not per_reward and rewards is None:
            adv[self.keep] = group_advantages(
                self.rewards[self.keep], groups, per_group_std, 1e-4, std_correction
            )
            return adv
        names = sorted(self.weights if rewards is None else rewards)
        if not names or any(n not in self.parts or n not in self.weights for n in names):
            raise ValueError(
                f"{'per-reward' if per_reward else 'per-modality'} advantages need each weighted reward's "
                f"scores and weight; the batch has scores of {sorted(self.parts)} and weights of "
                f"{sorted(self.weights)}, asked for {names}"
            )
        parts = torch.stack([self.parts[n][self.keep] for n in names])
        weights = torch.tensor([float(self.weights[n]) for n in names], dtype=torch.float64)
        if per_reward:
            adv[self.keep] = per_reward_advantages(
                parts, weights, groups, per_group_std, 1e-4, std_correction
            )
        else:
            combined = (weights[:, None] * parts.double()).sum(0) / weights.sum()
            adv[self.keep] = group_advantages(combined.float(), groups, per_group_std, 1e-4, std_correction)
        return adv

    def modality_advantages(
        self,
        modalities: Sequence[str],
        per_group_std: bool = False,
        std_correction: int = 0,
        per_reward: bool = False,
    ) -> torch.Tensor:
        """[N, M]: each of `modalities`' advantages from the rewards that judge it (credit.modality_routes
        of the rewards' declared modalities), normalised as `advantages` normalises."""
        routes = modality_routes(dict(self.modalities), tuple(modalities), self.weights)
        columns = [self.advantages(per_group_std, std_correction, per_reward, routes[m]) for m in modalities]
        return torch.stack(columns, dim=1)
