"""DiffusionNFT loss (negative-aware fine-tuning, arXiv 2509.16117) as a pure tensor function."""

from __future__ import annotations

import torch


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.flatten(1).mean(dim=1)


def _batch_mean(x: torch.Tensor, sample_weight: torch.Tensor | None) -> torch.Tensor:
    """mean over the batch of x [B], each sample's value times its weight when given."""
    return x.mean() if sample_weight is None else (sample_weight.to(x.dtype) * x).mean()


def _adaptive_x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """mean||x0_pred - x0||^2 / sg(mean|x0_pred - x0|), per sample (denominator floored at 1e-5)."""
    err = x0_pred - x0
    weight = _per_sample_mean(err.detach().abs().double()).clamp(min=1e-5).to(err.dtype)
    return _per_sample_mean(err**2) / weight


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    beta: float,
    adv_clip_max: float,
    v_ref: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """NFT loss for one timestep of a batch.

    v+ = (1 - beta) v_old + beta v_theta;  v- = (1 + beta) v_old - beta v_theta
    L = adv_clip_max * mean[(r L+ + (1 - r) L-) / beta] + kl_coef * mean||v_theta - v_ref||^2
    with L+- the adaptive x0-space losses of x0+- = x_t - t v+-.  t and r have shape [B].
    sample_weight [B]: each sample's term is multiplied by it before the batch mean (None: 1; a
    dropped sample that must still run its passes, as under sharding, weighs 0).
    """
    if beta <= 0:
        raise ValueError(f"beta must be > 0; got {beta}")
    v_old = v_old.detach()
    t_b = t.view(-1, *([1] * (x_t.ndim - 1))).to(x_t.dtype)
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    loss_pos = _adaptive_x0_loss(x_t - t_b * v_pos, x0)
    loss_neg = _adaptive_x0_loss(x_t - t_b * v_neg, x0)
    policy_loss = adv_clip_max * _batch_mean((r * loss_pos + (1 - r) * loss_neg) / beta, sample_weight)
    metrics = {
        "loss/policy": policy_loss.detach(),
        "loss/positive": _batch_mean(loss_pos, sample_weight).detach(),
        "loss/negative": _batch_mean(loss_neg, sample_weight).detach(),
    }
    loss = policy_loss
    if kl_coef > 0:
        if v_ref is None:
            raise ValueError("kl_coef > 0 needs v_ref (the base model's velocity)")
        kl = _batch_mean(_per_sample_mean((v_theta - v_ref.detach()) ** 2), sample_weight)
        metrics["loss/kl"] = kl.detach()
        loss = loss + kl_coef * kl
    return loss, metrics


def flow_matching_loss(
    v_pred: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor, sample_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """Plain rectified-flow fine-tuning loss mean||v - (eps - x0)||^2 (the benchmark's baseline);
    sample_weight [B] as in nft_loss."""
    if sample_weight is None:
        return ((v_pred - (noise - x0)) ** 2).mean()
    return _batch_mean(_per_sample_mean((v_pred - (noise - x0)) ** 2), sample_weight)
