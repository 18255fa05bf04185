"""Flow-GRPO (arXiv 2505.05470) and MixGRPO's window (arXiv 2507.21802) as pure tensor functions.

Convention: x_t = (1 - t) x0 + t eps, t = 1 is noise, the model predicts v = eps - x0, and a step
goes from t to t_next < t (dt = t_next - t < 0). The SDE with the ODE's marginals takes

    mean = x_t (1 + sigma^2 dt / (2 t)) + v (1 + sigma^2 (1 - t) / (2 t)) dt,
    x_next = mean + sigma sqrt(-dt) z,     sigma = a sqrt(t / (1 - t)),

with a the noise level (`sde_noise`). At t = 1, sigma's denominator uses 1 - t_cap (the grid's
second time), as the reference does. A step's log-probability is the Gaussian's, averaged over the
latent's entries (the reference's reduction, hence its small clip ranges).

Conventions that differ from yifan123/flow_grpo (each is a choice of the caller, not of these
functions): the reference also adds noise on the last step (to t = 0) and simply never trains it;
our sampler keeps it deterministic. The reference's KL divides ||mean - mean_ref||^2 by 2 sigma_t^2
(sigma_t alone, not the step's std), and so does `FlowGRPO`, so that `kl_coef` is in the reference's
units (its `beta`); the closed-form KL of the two Gaussian steps divides by 2 sigma_t^2 |dt|, 1/|dt|
times more.
"""

from __future__ import annotations

import math

import torch


def _per_sample(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """[B] times as [B, 1, ..., 1] on `like`'s device, in its dtype."""
    return t.to(device=like.device, dtype=like.dtype).reshape(-1, *([1] * (like.ndim - 1)))


def sde_sigma(t: torch.Tensor, noise_level: float, t_cap: float) -> torch.Tensor:
    """sigma_t = a sqrt(t / (1 - t)), with t = 1 replaced by `t_cap` in the denominator."""
    denominator = 1 - torch.where(t == 1, torch.as_tensor(t_cap, dtype=t.dtype, device=t.device), t)
    return torch.sqrt(t / denominator) * noise_level


def sde_step(
    v: torch.Tensor,
    x: torch.Tensor,
    t: torch.Tensor,
    t_next: torch.Tensor,
    noise_level: float,
    t_cap: float,
    noise: torch.Tensor | None = None,
    x_next: torch.Tensor | None = None,
    groups: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One SDE step from x at t [B] to t_next [B]; returns (x_next, log_prob [B] ([B, G] with
    `groups`, see gaussian_log_prob), mean, std [B,1..]).

    Give `x_next` to score a recorded step (training), or `noise` (z, like x) to take one (rollout).
    std is the transition's standard deviation sigma_t sqrt(-dt).
    """
    if (x_next is None) == (noise is None):
        raise ValueError("give exactly one of noise (to take a step) or x_next (to score one)")
    t_b, dt = _per_sample(t, x), _per_sample(t_next, x) - _per_sample(t, x)
    sigma = sde_sigma(t_b, noise_level, t_cap)
    mean = x * (1 + sigma**2 / (2 * t_b) * dt) + v * (1 + sigma**2 * (1 - t_b) / (2 * t_b)) * dt
    std = sigma * torch.sqrt(-dt)
    if x_next is None:
        x_next = mean + std * noise
    return x_next, gaussian_log_prob(x_next.detach(), mean, std, groups), mean, std


def gaussian_log_prob(
    x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor, groups: tuple[torch.Tensor, ...] = ()
) -> torch.Tensor:
    """[B] log N(x; mean, std^2) averaged over each sample's entries; with `groups` (index tensors
    over the flat entries, per-modality credit's modalities) [B, G], averaged over each group's."""
    log_density = -((x - mean) ** 2) / (2 * std**2) - torch.log(std) - math.log(math.sqrt(2 * math.pi))
    flat = log_density.flatten(1)
    if not groups:
        return flat.mean(dim=1)
    return torch.stack([flat[:, index.to(flat.device)].mean(dim=1) for index in groups], dim=1)


def gaussian_step_kl(mean: torch.Tensor, mean_ref: torch.Tensor, kl_std: torch.Tensor) -> torch.Tensor:
    """[B] mean over entries of ||mean - mean_ref||^2 / (2 kl_std^2): the KL of two Gaussians of one
    std when kl_std is the transition's std (the reference passes sigma_t alone)."""
    return ((mean - mean_ref.detach()) ** 2).flatten(1).mean(dim=1) / (2 * kl_std.flatten(1)[:, 0] ** 2)


def step_kl(
    mean: torch.Tensor, mean_ref: torch.Tensor, t: torch.Tensor, noise_level: float, t_cap: float
) -> torch.Tensor:
    """[B] flow_grpo's KL term of a step from t [B], in its `train.beta`'s units: the mean over
    entries of ||mean - mean_ref||^2 / (2 sigma_t^2). The KL of the two Gaussian steps is this / |dt|."""
    return gaussian_step_kl(mean, mean_ref, sde_sigma(_per_sample(t, mean), noise_level, t_cap))


def clipped_policy_loss(
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    clip_range: float,
    adv_clip_max: float,
    sample_weight: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate at one step of each sample, negated and averaged over the batch:
    mean[max(-A r, -A clip(r, 1 - eps, 1 + eps))] with r = exp(logp - logp_behaviour) and A the
    advantage clipped to [-adv_clip_max, adv_clip_max]. `sample_weight` [B] multiplies each term
    (None: 1). Metrics: the clipped fraction, approx KL 0.5 (logp - logp_b)^2 and |logp - logp_b|."""
    if clip_range <= 0:
        raise ValueError(f"clip_range must be > 0; got {clip_range}")
    advantages = advantages.to(log_prob.dtype).clamp(-adv_clip_max, adv_clip_max)
    log_ratio = log_prob - behaviour_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    per_sample = torch.maximum(unclipped, clipped)
    weight = torch.ones_like(per_sample) if sample_weight is None else sample_weight.to(per_sample.dtype)
    loss = (weight * per_sample).mean()
    metrics = {
        "loss/policy": loss.detach(),
        "grpo/clip_fraction": (weight * ((ratio - 1).abs() > clip_range)).mean().detach(),
        "grpo/approx_kl": (weight * 0.5 * log_ratio**2).mean().detach(),
        "grpo/logp_gap": (weight * log_ratio.abs()).mean().detach(),
    }
    return loss, metrics


def sde_window(step: int, end: int, size: int, stride: int, every: int) -> tuple[int, int]:
    """MixGRPO's window at training `step`: [start, min(start + size, end)). The start moves `stride`
    steps every `every` training steps; near the end the window shrinks, it is empty once the start
    reaches `end`, and the start rolls back to 0 once it would pass `end` (MixGRPO's progressive
    schedule with roll_back, `GRPOTrainingStates`). size 0: every step before `end` (no window)."""
    if size == 0:
        return 0, end
    if size > end:
        raise ValueError(f"an SDE window of {size} steps is larger than the {end} steps it may cover")
    start = ((step // every) % (end // stride + 1)) * stride
    return start, min(start + size, end)


def drawn_window(size: int, range_end: int, generator: torch.Generator) -> tuple[int, int]:
    """Flow-GRPO-Fast's window: [start, start + size) with start drawn uniformly from
    0 .. range_end - size (flow_grpo's `sde_window_range` (0, range_end))."""
    if not 0 < size <= range_end:
        raise ValueError(f"a drawn SDE window needs 0 < size <= range end; got {size} and {range_end}")
    start = int(torch.randint(0, range_end - size + 1, (), generator=generator))
    return start, start + size
