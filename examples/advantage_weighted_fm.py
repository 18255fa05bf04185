"""Advantage-weighted flow matching (AWFM): an algorithm added as a plug-in, in one file outside
the package. docs/adding-an-algorithm.md walks through it.

Every trainable sample is fitted with the plain flow-matching loss at the trained timesteps,
weighted by exp(A / temperature), A its group advantage clipped to [-clip, clip], the weights
scaled to mean 1 over the step's trainable samples. Better samples pull harder and none is thrown
away: RAFT keeps only each group's best, advantage-weighted regression (Peng et al., 2019) weighs
them all. Run it with

    odrl train recipes/configs/tiny_t2av_nft.yaml algorithm.plugins=[examples/advantage_weighted_fm.py] \
        algorithm.name=awfm
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from omni_diffusion_rl.algorithms.nft import flow_matching_loss
from omni_diffusion_rl.config import option
from omni_diffusion_rl.models.policy import index_condition
from omni_diffusion_rl.registry import algorithms
from omni_diffusion_rl.trainers.skeleton import (
    Algorithm,
    MicroBatch,
    Plan,
    UpdateBatch,
    finite_if_dropped,
    noised_inputs,
)


def advantage_weights(
    advantages: torch.Tensor, trainable: torch.Tensor, temperature: float, clip: float
) -> torch.Tensor:
    """[N] exp(clip(A) / temperature) for the trainable samples, scaled to mean 1 over them; 0 for
    the others (a pure function: the math of this algorithm, tested on its own)."""
    weights = torch.zeros_like(advantages)
    if trainable.any():
        raw = torch.exp(advantages[trainable].clamp(-clip, clip) / temperature)
        weights[trainable] = raw / raw.mean()
    return weights


@dataclass
class AWFMOptions:
    """AWFM's options: keys flat in the config's algorithm section (algorithm.awfm_temperature)."""

    awfm_temperature: float = option(1.0, "awfm: weights exp(A / temperature); lower is greedier", gt=0)
    awfm_clip: float = option(3.0, "awfm: advantages clipped to [-clip, clip] before exp", gt=0)


@algorithms.register("awfm")
class AdvantageWeightedFlowMatching(Algorithm):
    """Flow matching on every trainable sample, weighted by exp(its advantage / temperature)."""

    display_name = "AWFM"
    options_type = AWFMOptions

    def plan(self, batch: UpdateBatch) -> Plan:
        """What the update trains on: this process's trainable samples, their weights and their
        noised inputs (one pass per trained timestep, the same draws as DiffusionNFT's)."""
        a = self.options
        weights = advantage_weights(batch.advantages(), batch.keep, a.awfm_temperature, a.awfm_clip)
        inputs = noised_inputs(self.learner.cfg, batch.rollout, batch.step)
        return Plan(
            trained=batch.mine,
            data={"inputs": inputs, "weight": weights[batch.local]},
            passes=len(inputs),
            metrics={"awfm/weight_max": float(weights.max())},
        )

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The weighted flow-matching loss of one micro-batch at one trained timestep."""
        rollout, part = micro.work.rollout, micro.part
        device = rollout.x0.device
        t, noise, x_t = (v[part] for v in micro.work.data["inputs"][micro.index])
        weight = micro.rows("weight").to(device)
        dropped = micro.weight(device)  # sharded runs keep dropped samples in the batch at weight 0
        if dropped is not None:
            weight = weight * dropped
        with self.learner.autocast():
            v = self.learner.policy.velocity(
                finite_if_dropped(x_t, dropped), t, index_condition(rollout.cond, part)
            )
        x0 = finite_if_dropped(rollout.x0[part], dropped)
        loss = flow_matching_loss(v.float(), finite_if_dropped(noise, dropped), x0, weight)
        return loss, {"loss/total": loss.detach()}
