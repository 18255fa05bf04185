"""What the trainer learns with: an `Algorithm` turns a step's scored experience into one update.

The trainer (and every execution mode built on it) owns the experience, its gathering over
processes and the accounting of dropped samples; an algorithm receives the step's rewards, prompt
groups and trainable mask, computes its own learning signal, runs the backward passes on this
process's samples and calls `trainer.apply_gradients` once. Algorithms are registered by name
(`algorithm.name`); the rollout side always generates with the `old` adapter, which an algorithm
keeps as its rollout weights (DiffusionNFT: a soft-updated copy; RAFT: the trained adapter itself).

Adding an algorithm: subclass `Algorithm`, implement `metric_names` and `update`, register it with
`@algorithms.register("name")`, and select it with `algorithm.name=name`. RAFT below is the example.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..algorithms.advantages import group_advantages, optimality_probability
from ..algorithms.nft import flow_matching_loss, nft_loss
from ..algorithms.soft_update import old_adapter_decay
from ..models import lora
from ..registry import algorithms
from ..rollout import Rollout

if TYPE_CHECKING:
    from .nft import NFTTrainer


class Algorithm:
    """One update from a step's experience (see the module docstring)."""

    def __init__(self, trainer: NFTTrainer) -> None:
        self.trainer = trainer
        self.cfg = trainer.cfg.algorithm

    def metric_names(self) -> list[str]:
        """The loss metrics `update` logs, averaged over processes by trained samples."""
        raise NotImplementedError

    def update(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        """One optimizer step. rewards/groups/keep cover the whole step (every process); `local`
        selects this process's samples, which `rollout` holds."""
        raise NotImplementedError


@algorithms.register("nft")
class DiffusionNFT(Algorithm):
    """Negative-aware fine-tuning: r from group advantages, the NFT loss against the `old` adapter,
    then a soft update of `old` (algorithms/nft.py holds the math)."""

    def metric_names(self) -> list[str]:
        a, empty = self.cfg, torch.zeros(0, 1)
        _, metrics = nft_loss(
            empty,
            empty,
            empty,
            empty,
            torch.zeros(0),
            torch.zeros(0),
            a.beta,
            a.adv_clip_max,
            empty,
            a.kl_coef,
        )
        return sorted(["loss/total", *metrics])

    def update(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        a, trainer = self.cfg, self.trainer
        adv = torch.zeros(len(rewards))
        adv[keep] = group_advantages(rewards[keep], groups[keep], per_group_std=a.per_group_std)
        r = optimality_probability(adv[local], a.adv_clip_max, a.adv_mode)
        metrics = trainer.train_on(rollout, r, step, keep[local])
        metrics["r/mean"] = float(r[keep[local]].mean()) if keep[local].any() else float("nan")
        return metrics


@algorithms.register("raft")
class RewardRankedFineTuning(Algorithm):
    """RAFT / rejection-sampling fine-tuning: the `raft_keep` best trainable samples of each prompt
    group are fine-tuned on with the plain flow-matching loss at the trained timesteps; the rollout
    weights then follow the trained adapter (`old` := trained after every step)."""

    def metric_names(self) -> list[str]:
        return ["loss/flow_matching", "loss/total"]

    def update(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        trainer = self.trainer
        best = best_of_each_group(rewards, groups, keep, self.cfg.raft_keep)
        mine = best[local]
        inputs = trainer.noised_inputs(rollout, step)  # drawn for every sample: independent of the pick
        index = mine.nonzero().flatten()
        chosen = rollout.select(index)
        dev = index.to(rollout.x0.device)
        trainer.optimizer.zero_grad(set_to_none=True)
        total = 0.0
        for t, noise, x_t in inputs if len(index) else []:
            t, noise, x_t = t[dev], noise[dev], x_t[dev]
            v_theta = trainer.policy.velocity(x_t, t, chosen.cond)
            loss = flow_matching_loss(v_theta, noise, chosen.x0)
            (loss / len(inputs)).backward()
            total += float(loss.detach()) / len(inputs)
        out = trainer._weighted_mean_over_ranks(
            {"loss/flow_matching": total, "loss/total": total}, float(len(index))
        )
        trainer.apply_gradients(out, weight=float(len(index)))
        lora.soft_update_old(trainer.transformer, old_adapter_decay("copy", step + 1))
        out["raft/trained_samples"] = float(best.sum())
        return out


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


def build_algorithm(trainer: Any) -> Algorithm:
    """The algorithm `algorithm.name` names, for this trainer."""
    return algorithms.get(trainer.cfg.algorithm.name)(trainer)
