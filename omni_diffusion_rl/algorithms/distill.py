"""On-policy distillation's loss and its weightings, pure tensor functions (the algorithm is
trainers/distill.py)."""

from __future__ import annotations

import torch

from ..algorithm_options import DISTILL_TARGETS as DISTILL_TARGETS
from ..algorithm_options import DISTILL_WEIGHTINGS as DISTILL_WEIGHTINGS
from .flow_grpo import sde_sigma

SDE_KL_NOISE = 0.7
"""The SDE noise level of the sde_kl weighting (Flow-GRPO's default)."""


def endpoint_velocities(states: torch.Tensor, x0_teacher: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """[N, T, ...]: the straight-line velocity (x_k - x0_T) / t_k from each state x_k = states[:, k]
    at time t_k > 0 to the teacher's sample x0_T [N, ...] (under x_t = (1 - t) x0 + t noise).

    Trained toward these, the student's x0 prediction at every state it visits is pulled to the
    teacher's sample from the same noise; the fixed point is a student whose sampler walks the straight
    line from that noise to the teacher's sample, so a few pixels that decide a shape weigh as much at
    the noisy states as at the clean end."""
    if times.ndim != 1 or len(times) != states.shape[1] or not bool((times > 0).all()):
        raise ValueError(
            f"endpoint targets need one time > 0 per state ({states.shape[1]} states); got {times.tolist()}"
        )
    if x0_teacher.shape != (states.shape[0], *states.shape[2:]):
        raise ValueError(
            f"the teacher's samples {tuple(x0_teacher.shape)} do not fit states {tuple(states.shape)}"
        )
    t = times.to(states.dtype).view(1, -1, *([1] * (states.ndim - 2)))
    return (states - x0_teacher[:, None].to(states.dtype)) / t


def completion_velocities(starts: torch.Tensor, endpoints: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """[M, ...]: the straight-line velocity (x - x0) / t from each start state x = starts[m] at time
    t = times[m] > 0 to the teacher's completion x0 = endpoints[m], its own ODE run from that state.

    The target is a function of the state alone (the teacher's flow map from it), so the student can
    meet it exactly; at a noisy state the teacher decides what the student has not (the shape), at a
    late one it keeps what the student already drew, and from the last state it is the teacher's
    velocity there."""
    if times.shape != starts.shape[:1] or not bool((times > 0).all()):
        raise ValueError(f"completion targets need one time > 0 per start state; got {times.tolist()}")
    if endpoints.shape != starts.shape:
        raise ValueError(
            f"the completions {tuple(endpoints.shape)} do not fit the states {tuple(starts.shape)}"
        )
    t = times.to(starts.dtype).view(-1, *([1] * (starts.ndim - 1)))
    return (starts - endpoints.to(starts.dtype)) / t


def distillation_loss(
    v_student: torch.Tensor,
    v_teacher: torch.Tensor,
    weight: torch.Tensor,
    focus: float = 0.0,
    answered: torch.Tensor | None = None,
) -> torch.Tensor:
    """mean over samples of weight * mean_d f_d (v_student - sg v_teacher)^2; weight has shape [B].

    focus 0: f_d = 1. focus > 0: f_d = (|e_d| / mean_d |e_d|)^focus with e = v_student - v_teacher,
    then scaled to mean 1 over each sample's entries and detached (no gradient through the weights):
    more of the loss where the two disagree most, such as the few pixels that tell a circle from a
    square. Exactly 0 when the student's velocity equals the teacher's (self-distillation at the start).
    `answered` (bool, v's shape): the entries a teacher answered for (teacher routes); the means over
    d, and the focus, are taken over those only, as if the others were not in the latent.
    """
    if focus < 0:
        raise ValueError(f"focus must be >= 0, got {focus}")
    squared = (v_student - v_teacher.detach()) ** 2
    per_entry = squared.flatten(1)
    if answered is not None:
        return _answered_loss(per_entry, answered.flatten(1).to(per_entry.dtype), weight, focus)
    if focus > 0:
        gap = per_entry.detach().sqrt()
        share = (gap / gap.mean(dim=1, keepdim=True).clamp_min(1e-12)) ** focus
        per_entry = per_entry * (share / share.mean(dim=1, keepdim=True).clamp_min(1e-12))
    per_sample = per_entry.mean(dim=1)
    return (weight.to(per_sample.dtype) * per_sample).mean()


def _answered_loss(
    per_entry: torch.Tensor, counted: torch.Tensor, weight: torch.Tensor, focus: float
) -> torch.Tensor:
    """distillation_loss over the `counted` entries (1) only: the others' targets are never seen."""
    per_entry = per_entry * counted
    count = counted.sum(dim=1, keepdim=True).clamp_min(1)
    if focus > 0:
        gap = per_entry.detach().sqrt()
        share = (gap / (gap.sum(dim=1, keepdim=True) / count).clamp_min(1e-12)) ** focus * counted
        per_entry = per_entry * (share / (share.sum(dim=1, keepdim=True) / count).clamp_min(1e-12))
    per_sample = per_entry.sum(dim=1) / count[:, 0]
    return (weight.to(per_sample.dtype) * per_sample).mean()


def state_weights(grid: torch.Tensor, weighting: str) -> torch.Tensor:
    """[T] weight of the state at each sampler time t_k (step k goes to t_{k+1}), scaled to mean 1 so
    that the learning rate keeps its meaning:

    - uniform: 1;
    - step: dt_k^2, the transition-mean form of an Euler step;
    - x0: t_k^2, matching the two x0 predictions x_t - t v (||x0_s - x0_T||^2 = t^2 ||v_s - v_T||^2):
      the noisy states, where the layout is decided, weigh most;
    - sde_kl: c_k^2 |dt_k| / sigma_k^2, the closed-form KL of the student's and the teacher's
      Gaussian steps of Flow-GRPO's SDE (noise level `SDE_KL_NOISE`) per unit squared velocity gap,
      sigma_k = a sqrt(t_k / (1 - t_k)) (t = 1 takes the grid's second time, as the SDE does) and
      c_k = 1 + sigma_k^2 (1 - t_k) / (2 t_k) the velocity's factor in the step's mean: the clean
      end weighs most.
    """
    if weighting not in DISTILL_WEIGHTINGS:
        raise ValueError(
            f"unknown distill weighting '{weighting}'; choose one of {', '.join(DISTILL_WEIGHTINGS)}"
        )
    t, t_next = grid[:-1].double(), grid[1:].double()
    if weighting == "uniform":
        weights = torch.ones_like(t)
    elif weighting == "step":
        weights = (t - t_next) ** 2
    elif weighting == "x0":
        weights = t**2
    else:
        sigma2 = sde_sigma(t, SDE_KL_NOISE, float(grid[1])) ** 2
        weights = (1 + sigma2 * (1 - t) / (2 * t)) ** 2 * (t - t_next) / sigma2
    return (weights / weights.mean()).float()
