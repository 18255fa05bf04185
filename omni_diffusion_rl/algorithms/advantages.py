"""Group-relative advantages and their map to an optimality probability r in [0, 1]."""

from __future__ import annotations

import torch

from ..algorithm_options import ADV_MODES as ADV_MODES
from ..algorithm_options import STD_CORRECTIONS as STD_CORRECTIONS


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    per_group_std: bool = False,
    eps: float = 1e-4,
    std_correction: int = 0,
) -> torch.Tensor:
    """A = (R - mean of R's prompt group) / (std + eps).

    std is the std of the whole batch by default, or of each group; std_correction 0 is the
    population std (ddof 0), 1 the sample std with Bessel's correction (trl's GRPO/GSPO: larger by
    sqrt(G / (G - 1)) for groups of G, so advantages are smaller by sqrt((G - 1) / G), 0.935 at G=8).
    Pass the rewards of the whole training batch (all processes) so every rank agrees.
    """
    if rewards.ndim != 1 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be 1-D, equal"
        )
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf; a failed reward must be an error, not a score")
    rewards = rewards.double()
    _, inverse, counts = torch.unique(group_ids, return_inverse=True, return_counts=True)
    if (counts < 2).any():
        raise ValueError("every prompt group needs at least 2 samples: group advantages are undefined for 1")
    sums = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, rewards)
    centred = rewards - (sums / counts)[inverse]
    if per_group_std:
        squares = torch.zeros(len(counts), dtype=rewards.dtype).index_add_(0, inverse, centred**2)
        std = (squares / (counts - std_correction)).sqrt()[inverse]
    else:
        std = rewards.std(correction=std_correction)
    return (centred / (std + eps)).float()


def per_reward_advantages(
    parts: torch.Tensor,
    weights: torch.Tensor,
    group_ids: torch.Tensor,
    per_group_std: bool = False,
    eps: float = 1e-4,
    std_correction: int = 0,
) -> torch.Tensor:
    """A = S / (std of S over the batch + eps), S = sum_k w_k * group_advantages(parts[k]).

    parts [K, N] holds each reward's scores and weights [K] its weight. Each reward is centred and
    scaled within its prompt groups on its own before the weighted sum, so a reward whose scores
    spread little (a small IoU margin) still ranks a group's samples as much as one that spreads
    widely (GDPO's decoupled normalisation). The price: a solved reward's leftover noise is scaled
    up the same way. A reward equal over the whole batch adds nothing.
    """
    if parts.ndim != 2 or weights.shape != parts.shape[:1] or parts.shape[1:] != group_ids.shape:
        raise ValueError(
            f"parts {tuple(parts.shape)} must be [K, N] for weights {tuple(weights.shape)} [K] "
            f"and group_ids {tuple(group_ids.shape)} [N]"
        )
    if not torch.isfinite(parts).all():
        raise ValueError("reward parts contain NaN or inf; a failed reward must be an error, not a score")
    summed = torch.zeros(parts.shape[1], dtype=torch.float64)
    for scores, weight in zip(parts, weights.tolist(), strict=True):
        if scores.double().std(correction=0) > 0:  # a constant reward has no ranking to add
            summed += (
                weight * group_advantages(scores, group_ids, per_group_std, eps, std_correction).double()
            )
    return (summed / (summed.std(correction=std_correction) + eps)).float()


def optimality_probability(
    advantages: torch.Tensor, adv_clip_max: float = 5.0, mode: str = "continuous"
) -> torch.Tensor:
    """r = clamp(A' / adv_clip_max / 2 + 0.5, 0, 1) with A' the clipped advantage shaped by `mode`."""
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    if mode == "positive_only":
        a = a.clamp(0, adv_clip_max)
    elif mode == "negative_only":
        a = a.clamp(-adv_clip_max, 0)
    elif mode == "one_only":
        a = (a > 0).to(a.dtype)
    elif mode == "binary":
        a = torch.sign(a)
    elif mode != "continuous":
        raise ValueError(f"unknown adv_mode '{mode}'; choose one of {', '.join(ADV_MODES)}")
    return (a / adv_clip_max / 2 + 0.5).clamp(0, 1)
