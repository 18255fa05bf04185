"""Classifier-free guidance as a pure function of the two velocities."""

from __future__ import annotations

import torch


def guided_velocity(v_prompt: torch.Tensor, v_empty: torch.Tensor, scale: float) -> torch.Tensor:
    """v = v(empty) + scale * (v(prompt) - v(empty)); scale 1 gives v(prompt) exactly."""
    if scale == 1.0:
        return v_prompt
    return v_empty + scale * (v_prompt - v_empty)
