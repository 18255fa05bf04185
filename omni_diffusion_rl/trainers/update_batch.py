"""What an algorithm's update learns from: one step's scored experience (`UpdateBatch`). Its own
module, so that execution modes and the planner can hand an update its batch without importing an
algorithm."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ..algorithms.advantages import group_advantages, per_reward_advantages
from ..experience.rollout import Rollout


@dataclass(frozen=True)
class UpdateBatch:
    """One step's experience as an update sees it: rewards, prompt groups and the trainable mask
    over every process ([N] each, in rank order), this process's samples (`rollout`, rows `local`
    of the N; a TextRollout for an algorithm that trains answers) and the step (counted from 0).
    `parts` holds each reward's own scores [N] and `weights` its weight, for per-reward advantages."""

    rollout: Rollout
    rewards: torch.Tensor
    groups: torch.Tensor
    keep: torch.Tensor
    local: slice
    step: int
    parts: Mapping[str, torch.Tensor] = field(default_factory=dict)
    weights: Mapping[str, float] = field(default_factory=dict)

    @property
    def mine(self) -> torch.Tensor:
        """[n] bool: which of this process's samples are trainable."""
        return self.keep[self.local]

    def advantages(
        self, per_group_std: bool = False, std_correction: int = 0, per_reward: bool = False
    ) -> torch.Tensor:
        """[N] group-relative advantages of the trainable samples over the whole step (0 for the
        others); per_reward: each reward normalised on its own, then summed with its weight."""
        adv = torch.zeros(len(self.rewards))
        groups = self.groups[self.keep]
        if not per_reward:
            adv[self.keep] = group_advantages(
                self.rewards[self.keep], groups, per_group_std, 1e-4, std_correction
            )
            return adv
        names = sorted(self.weights)
        if not names or any(n not in self.parts for n in names):
            raise ValueError(
                f"per-reward advantages need each weighted reward's scores; the batch has "
                f"{sorted(self.parts)} for the weights {names}"
            )
        parts = torch.stack([self.parts[n][self.keep] for n in names])
        weights = torch.tensor([float(self.weights[n]) for n in names], dtype=torch.float64)
        adv[self.keep] = per_reward_advantages(parts, weights, groups, per_group_std, 1e-4, std_correction)
        return adv
