"""Generate a batch with the policy and score it: the rollout keeps only x0, condition and grid."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models.policy import Condition, FlowPolicy, cat_conditions, index_condition, repeat_condition
from .reward import ScoreResult, WeightedReward
from .sampling import policy_time_grid, sample_ode


@dataclass
class Rollout:
    prompts: list[str]  # one per sample
    group_ids: torch.Tensor  # [N] global prompt-group id of each sample
    x0: torch.Tensor  # [N, *latent]
    cond: Condition
    grid: torch.Tensor  # [T + 1] sampler times, 1 -> 0

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, index: torch.Tensor) -> Rollout:
        """The samples at `index` (a 1-D index tensor)."""
        return Rollout(
            prompts=[self.prompts[i] for i in index.tolist()],
            group_ids=self.group_ids[index],
            x0=self.x0[index.to(self.x0.device)],
            cond=index_condition(self.cond, index.to(self.x0.device)),
            grid=self.grid,
        )

    def to(self, device: torch.device) -> Rollout:
        """x0 and the condition on `device` (what came from another process is on the CPU)."""
        cond = {k: v.to(device) for k, v in self.cond.items()}
        return Rollout(self.prompts, self.group_ids, self.x0.to(device), cond, self.grid)

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        return Rollout(
            prompts=[p for r in parts for p in r.prompts],
            group_ids=torch.cat([r.group_ids for r in parts]),
            x0=torch.cat([r.x0 for r in parts]),
            cond=cat_conditions([r.cond for r in parts]),
            grid=parts[0].grid,
        )


def generate(
    policy: FlowPolicy,
    prompts: list[str],
    group_ids: list[int],
    noise: torch.Tensor,
    num_steps: int,
    time_shift: float,
    solver: str,
) -> Rollout:
    """len(noise) / len(prompts) samples per prompt (consecutive), integrated from `noise`.

    The time grid is the policy's own (`policy_time_grid`): diffusers policies use their
    scheduler's grid, the built-in tiny model the uniform one. Training reuses `Rollout.grid`.
    """
    group_size = len(noise) // len(prompts)
    if group_size * len(prompts) != len(noise):
        raise ValueError(f"{len(noise)} noise samples do not split into groups for {len(prompts)} prompts")
    device = next(policy.transformer.parameters()).device
    cond = repeat_condition(policy.encode_prompts(prompts), group_size)
    cond = {k: v.to(device) for k, v in cond.items()}
    noise = noise.to(device)
    grid = policy_time_grid(policy, num_steps, time_shift)  # the diffusers scheduler's or uniform
    x0 = sample_ode(lambda x, t: policy.velocity(x, t.to(device), cond), noise, grid, solver)
    return Rollout(
        prompts=[p for p in prompts for _ in range(group_size)],
        group_ids=torch.tensor(group_ids).repeat_interleave(group_size),
        x0=x0,
        cond=cond,
        grid=grid,
    )


@torch.no_grad()
def score(policy: FlowPolicy, reward: WeightedReward, rollout: Rollout) -> ScoreResult:
    return reward(policy.decode(rollout.x0), rollout.prompts, check=False)


def cat_results(parts: list[ScoreResult]) -> ScoreResult:
    """Score results of consecutive chunks as one (failure indices shifted to the joined batch)."""
    failures, offset = {}, 0
    for part in parts:
        failures.update({offset + i: reason for i, reason in part.failures.items()})
        offset += len(part.total)
    names = sorted({k for p in parts for k in p.parts})  # a chunk may lack a component another has

    def column(p: ScoreResult, k: str) -> torch.Tensor:
        return p.parts.get(k, torch.full((len(p.total),), float("nan")))

    return ScoreResult(
        torch.cat([p.total for p in parts]),
        {k: torch.cat([column(p, k) for p in parts]) for k in names},
        failures,
    )
