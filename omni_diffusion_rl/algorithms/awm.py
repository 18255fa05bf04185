"""Advantage weighted matching (AWM, arXiv 2509.25050) as pure tensor functions.

AWM trains on the rollout's clean samples x0 with the pretraining objective: each is noised afresh
at a few timesteps, x_t = (1 - t) x0 + t eps, and the model's flow-matching error there,
m = mean over entries of (v - (eps - x0))^2, stands in for a log-likelihood. The policy loss weights
it by the sample's advantage, so a better sample is matched more and a worse one less. As in the
reference (scxue/advantage_weighted_matching, scripts/train_sd3_awm.py):

- the log-likelihood is -m ('uniform'), or by default the generalised Huber form 'ghuber',
  -t ((m + 1e-10)^p - 1e-10^p) / p with p = 0.25, computed in float64;
- advantages are clipped to [-c, c] and divided by c (c = adv_clip_max, the reference's
  advantage_max = 1);
- the loss has PPO's shape against the same pass's detached log-likelihood, so its ratio is 1 and
  its gradient is -A grad(l) (the reference trains on-policy, one optimizer step per batch);
- the penalties are mean (v - v_ref)^2 to the base model and mean (v - v_ema)^2 to a lagged copy of
  the adapter (the 'uniform' KL weights of the reference);
- the trained timesteps are stratified over the sampler's grid indices ('discrete_wo_init': strata
  of [1, int(num_steps * timestep_fraction)], one index drawn in each).
"""

from __future__ import annotations

import torch

from ..algorithm_options import AWM_WEIGHTINGS as WEIGHTINGS
from ..algorithm_options import awm_index_range

_TINY = 1e-10  # the reference's floor inside the power


def matching_error(v: torch.Tensor, noise: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """[B] float64: m = mean over entries of (v - (noise - x0))^2, the flow-matching error at x_t."""
    return ((v.double() - (noise.double() - x0.double())) ** 2).flatten(1).mean(dim=1)


def matching_log_likelihood(
    error: torch.Tensor, t: torch.Tensor, weighting: str = "ghuber", power: float = 0.25
) -> torch.Tensor:
    """[B] float64: AWM's log-likelihood surrogate of x0 from its matching error m [B] at t [B]."""
    if weighting == "uniform":
        return -error
    if weighting == "ghuber":
        if power <= 0:
            raise ValueError(f"the ghuber power must be > 0; got {power}")
        floor = torch.tensor(_TINY, dtype=torch.float64)
        return -((error + _TINY) ** power - floor**power) * t.double().reshape(-1) / power
    raise ValueError(f"unknown AWM weighting {weighting!r}; choose one of {', '.join(WEIGHTINGS)}")


def awm_policy_loss(
    log_likelihood: torch.Tensor,
    advantages: torch.Tensor,
    adv_clip_max: float,
    sample_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """mean over the batch of -A' exp(l - sg(l)), A' = clamp(A, -c, c) / c: value -mean(A'), gradient
    -mean(A' grad l). sample_weight [B] multiplies each term (None: 1)."""
    if adv_clip_max <= 0:
        raise ValueError(f"adv_clip_max must be > 0; got {adv_clip_max}")
    scaled = advantages.to(log_likelihood.dtype).clamp(-adv_clip_max, adv_clip_max) / adv_clip_max
    per_sample = -scaled * torch.exp(log_likelihood - log_likelihood.detach())
    if sample_weight is not None:
        per_sample = sample_weight.to(per_sample.dtype) * per_sample
    return per_sample.mean()


def velocity_gap(v: torch.Tensor, v_other: torch.Tensor) -> torch.Tensor:
    """[B] mean over entries of (v - sg(v_other))^2: AWM's KL penalty to the base or the lagged copy."""
    return ((v - v_other.detach()) ** 2).flatten(1).mean(dim=1)


def stratified_step_indices(
    num_steps: int, fraction: float, count: int, generator: torch.Generator, skip_first: bool = True
) -> torch.Tensor:
    """[count] indices into the sampler's grid: the range [1 (0 when not skip_first),
    int(num_steps * fraction)] cut into `count` strata (linspace, floored), one index drawn uniformly
    inside each (its lower edge when a stratum is empty)."""
    low, top = awm_index_range(num_steps, fraction, count, skip_first)
    bounds = torch.linspace(low, top, count + 1, dtype=torch.float32)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    return lower + (torch.rand(count, generator=generator) * (upper - lower)).long()


def ema_decay(step: int, most: float, per_step: float) -> float:
    """The lagged copy's decay after update number `step` (from 1): min(most, per_step * step) (the
    reference's linear kl_ema_decay_type: 0.001 a step up to 0.3)."""
    return min(most, per_step * step)
