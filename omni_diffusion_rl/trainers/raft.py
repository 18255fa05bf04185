"""RAFT (algorithm.name=raft), the short example of an algorithm on the shared update: fine-tune on
each group's best samples with the plain flow-matching loss."""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm_options import RAFTOptions, check_raft
from ..algorithms.nft import flow_matching_loss
from ..config import ExperimentConfig
from ..registry import algorithms
from .skeleton import Algorithm, MicroBatch, NoisedRows, Plan, UpdateBatch, noised_inputs


@algorithms.register("raft")
class RewardRankedFineTuning(Algorithm):
    """RAFT / rejection-sampling fine-tuning: the `raft_keep` best trainable samples of each prompt
    group are fine-tuned on with the plain flow-matching loss at the trained timesteps; the rollout
    weights then follow the trained adapter (`old` := trained after every step)."""

    display_name = "RAFT"
    options_type = RAFTOptions

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_raft(cfg)

    def metric_names(self) -> list[str]:
        return ["loss/flow_matching", "loss/total"]

    def plan(self, batch: UpdateBatch) -> Plan:
        best = best_of_each_group(batch.rewards, batch.groups, batch.keep, self.options.raft_keep)
        inputs = noised_inputs(
            self.learner.cfg, batch.rollout, batch.step
        )  # for every sample: not the pick's
        return Plan(
            best[batch.local], {"inputs": inputs}, len(inputs), {"raft/trained_samples": float(best.sum())}
        )

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        rows = NoisedRows.of(micro)
        with self.learner.autocast():
            v = self.learner.policy.velocity(rows.x_t, rows.t, rows.cond)
        loss = flow_matching_loss(v.float(), rows.noise, rows.x0, rows.weight)
        return loss, {"loss/flow_matching": loss.detach(), "loss/total": loss.detach()}


def best_of_each_group(
    rewards: torch.Tensor, groups: torch.Tensor, keep: torch.Tensor, top: int
) -> torch.Tensor:
    """[N] bool: the `top` highest-reward samples of each group among those `keep` allows (ties by
    position)."""
    chosen = torch.zeros(len(rewards), dtype=torch.bool)
    for g in groups[keep].unique().tolist():
        members = (keep & (groups == g)).nonzero().flatten()
        order = torch.argsort(rewards[members], descending=True, stable=True)
        chosen[members[order[:top]]] = True
    return chosen
