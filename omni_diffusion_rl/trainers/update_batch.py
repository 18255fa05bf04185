"""What an algorithm's update learns from: one step's scored experience (`UpdateBatch`). Its own
module, so that execution modes and the planner can hand an update its batch without importing an
algorithm."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algorithms.advantages import group_advantages
from ..experience.rollout import Rollout


@dataclass(frozen=True)
class UpdateBatch:
    """One step's experience as an update sees it: rewards, prompt groups and the trainable mask
    over every process ([N] each, in rank order), this process's samples (`rollout`, rows `local`
    of the N; a TextRollout for an algorithm that trains answers) and the step (counted from 0)."""

    rollout: Rollout
    rewards: torch.Tensor
    groups: torch.Tensor
    keep: torch.Tensor
    local: slice
    step: int

    @property
    def mine(self) -> torch.Tensor:
        """[n] bool: which of this process's samples are trainable."""
        return self.keep[self.local]

    def advantages(self, per_group_std: bool = False, std_correction: int = 0) -> torch.Tensor:
        """[N] group-relative advantages of the trainable samples over the whole step (0 for the others)."""
        adv = torch.zeros(len(self.rewards))
        adv[self.keep] = group_advantages(
            self.rewards[self.keep],
            self.groups[self.keep],
            per_group_std=per_group_std,
            std_correction=std_correction,
        )
        return adv
