"""Generate a batch with the policy and score it: the rollout keeps only x0, condition and grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.policy import Condition, FlowPolicy, repeat_condition
from .reward import WeightedReward
from .sampling import sample_ode, time_grid


@dataclass
class Rollout:
    prompts: list[str]  # one per sample
    group_ids: torch.Tensor  # [N] global prompt-group id of each sample
    x0: torch.Tensor  # [N, *latent]
    cond: Condition
    grid: torch.Tensor  # [T + 1] sampler times, 1 -> 0


def generate(
    policy: FlowPolicy,
    prompts: list[str],
    group_ids: list[int],
    noise: torch.Tensor,
    num_steps: int,
    time_shift: float,
    solver: str,
) -> Rollout:
    """len(noise) / len(prompts) samples per prompt (consecutive), integrated from `noise`."""
    group_size = len(noise) // len(prompts)
    if group_size * len(prompts) != len(noise):
        raise ValueError(f"{len(noise)} noise samples do not split into groups for {len(prompts)} prompts")
    device = next(policy.transformer.parameters()).device
    cond = repeat_condition(policy.encode_prompts(prompts), group_size)
    cond = {k: v.to(device) for k, v in cond.items()}
    noise = noise.to(device)
    grid = time_grid(num_steps, time_shift)
    x0 = sample_ode(lambda x, t: policy.velocity(x, t.to(device), cond), noise, grid, solver)
    return Rollout(
        prompts=[p for p in prompts for _ in range(group_size)],
        group_ids=torch.tensor(group_ids).repeat_interleave(group_size),
        x0=x0,
        cond=cond,
        grid=grid,
    )


@torch.no_grad()
def score(
    policy: FlowPolicy, reward: WeightedReward, rollout: Rollout
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    return reward(policy.decode(rollout.x0), rollout.prompts)
