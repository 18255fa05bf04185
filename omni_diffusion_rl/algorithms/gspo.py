"""GSPO (group sequence policy optimisation, arXiv 2507.18071) for autoregressive policies, and GRPO's
token-level ratio as a choice: pure tensor functions over per-token log-probabilities.

Shapes: log-probs and masks are [B, L] over the answer's tokens (the prompt excluded), the mask 1 on
the tokens an answer has (its end-of-sequence token included) and 0 on padding; advantages are [B].
Padding never changes a value: masked entries are ignored even when they hold NaN or inf.
"""

from __future__ import annotations

import torch

from ..algorithm_options import RATIO_LEVELS

GSPO_EPS_LOW, GSPO_EPS_HIGH = 3e-4, 4e-4  # the GSPO paper's clip range


def _masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def answer_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] mean of `values` over each answer's tokens (0 for an answer of no tokens)."""
    mask = mask.bool()
    return _masked(values, mask).sum(-1) / mask.sum(-1).clamp(min=1).to(values.dtype)


def sequence_log_ratio(logp: torch.Tensor, behaviour_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] log s_i = mean over the answer's tokens of log pi_theta - log pi_behaviour."""
    return answer_mean(logp - behaviour_logp, mask)


def policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float = GSPO_EPS_LOW,
    eps_high: float = GSPO_EPS_HIGH,
    level: str = "sequence",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped surrogate, negated: mean over answers of the answer-mean over tokens of
    -min(w A, clip(w, 1 - eps_low, 1 + eps_high) A), with w the sequence ratio s_i shared by the
    answer's tokens (`sequence`, GSPO) or each token's own ratio (`token`, GRPO). Aggregating per
    answer, then over answers, keeps a long answer from weighing more than a short one.

    Convention (differs from the paper and trl): the log-ratio is clamped at 20 before exp, so the
    ratio never overflows to inf. For A > 0 the clip at 1 + eps_high binds long before that and
    nothing changes; for A < 0, where the unclipped term w A is the smaller one, the loss of an answer
    whose log-ratio exceeds 20 (w > 5e8: an answer the behaviour policy almost never sampled) is
    capped at e^20 |A| and its gradient is 0, where trl's grows without bound.

    Returns the loss and its statistics: the share of clipped ratios, the ratio's mean and its
    largest distance from 1."""
    if level not in RATIO_LEVELS:
        raise ValueError(f"ratio level must be one of {', '.join(RATIO_LEVELS)}; got {level!r}")
    if logp.shape != behaviour_logp.shape or logp.shape != mask.shape or advantages.shape != logp.shape[:1]:
        raise ValueError(
            f"log-probs {tuple(logp.shape)}, behaviour log-probs {tuple(behaviour_logp.shape)} and mask "
            f"{tuple(mask.shape)} must be [B, L] alike, advantages {tuple(advantages.shape)} [B]"
        )
    mask = mask.bool()
    diff = _masked(logp - behaviour_logp.detach(), mask)
    log_w = sequence_log_ratio(logp, behaviour_logp.detach(), mask)[:, None] if level == "sequence" else diff
    ratio = torch.exp(log_w.clamp(max=20.0))  # far outside any clip range already; never inf
    clipped = ratio.clamp(1 - eps_low, 1 + eps_high)
    a = advantages.to(ratio.dtype)[:, None]
    per_token = -torch.minimum(ratio * a, clipped * a).expand(mask.shape)
    loss = answer_mean(per_token, mask).mean()
    with torch.no_grad():
        counted = mask if level == "token" else mask.any(-1, keepdim=True)
        r = ratio.expand(mask.shape) if level == "token" else ratio
        n = counted.sum().clamp(min=1)
        stats = {
            "clip_fraction": float(((r != r.clamp(1 - eps_low, 1 + eps_high)) & counted).sum() / n),
            "ratio_mean": float(_masked(r, counted).sum() / n),
            "ratio_max_dev": float(_masked((r - 1).abs(), counted).max()) if counted.any() else 0.0,
        }
    return loss, stats
