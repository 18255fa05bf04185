"""Classifier-free guidance on a policy: the guided velocity, the empty prompt's condition, and the
check that a model takes the empty prompt at all (sampling.cfg_scale)."""

from __future__ import annotations

import torch

from ..algorithms.guidance import guided_velocity
from ..config import ConfigError
from ..models.policy import Condition, FlowPolicy


def guided(
    policy: FlowPolicy,
    x_t: torch.Tensor,
    t: torch.Tensor,
    cond: Condition,
    empty: Condition | None,
    scale: float,
    detach_uncond: bool = False,
) -> torch.Tensor:
    """The policy's velocity with classifier-free guidance toward `cond` away from `empty` (the empty
    prompt's condition, one row per sample); scale 1 (or no `empty`) is one plain forward.
    detach_uncond: no gradient flows through the unconditional velocity."""
    v = policy.velocity(x_t, t, cond)
    if scale == 1.0 or empty is None:
        return v
    uncond = policy.velocity(x_t, t, empty)
    return guided_velocity(v, uncond.detach() if detach_uncond else uncond, scale)


def checked_guidance(
    policy: FlowPolicy, scale: float, algorithm: str = "", trains_guided: bool = True
) -> float:
    """`scale`, once the algorithm is known to train the guided velocity (else its rollouts would not
    be its own samples) and the policy to take the empty prompt guidance needs (ConfigError if not)."""
    if scale != 1.0 and not trains_guided:
        raise ConfigError(
            f"sampling.cfg_scale={scale:g}: algorithm.name={algorithm} trains the unguided velocity, so "
            "guided rollouts would not be its own samples; use sampling.cfg_scale=1, or "
            "algorithm.name=flow_grpo, which trains the guided policy"
        )
    if scale != 1.0:
        try:
            policy.encode_prompts([""])
        except ValueError as e:
            raise ConfigError(
                f"sampling.cfg_scale={scale:g} needs the empty prompt, which this model refuses ({e}); "
                "use sampling.cfg_scale=1"
            ) from e
    return scale


def encode_empty(policy: FlowPolicy, device: torch.device | str) -> Condition:
    """The empty prompt's condition (one row) on `device`, encoded with autocast off: the rollout
    and the loss (on whichever process) get the same tensors."""
    with torch.autocast(device_type=torch.device(device).type, enabled=False):
        return {k: v.to(device) for k, v in policy.encode_prompts([""]).items()}
