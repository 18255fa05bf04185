"""On-policy distillation's loss, a pure tensor function (the algorithm is trainers/algorithms.py)."""

from __future__ import annotations

import torch


def distillation_loss(v_student: torch.Tensor, v_teacher: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """mean over samples of weight * mean_d (v_student - sg v_teacher)^2; weight has shape [B].

    Exactly 0 when the student's velocity equals the teacher's (self-distillation at the start)."""
    per_sample = ((v_student - v_teacher.detach()) ** 2).flatten(1).mean(dim=1)
    return (weight.to(per_sample.dtype) * per_sample).mean()
