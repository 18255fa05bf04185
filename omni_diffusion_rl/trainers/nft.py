"""DiffusionNFT (algorithm.name=nft) on the shared update (skeleton.py); algorithms/nft.py holds the
loss, algorithm_options.py the options. examples/nft_in_one_file.py is the same step on one page."""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm_options import NFTOptions, check_nft
from ..algorithms.advantages import optimality_probability
from ..algorithms.nft import nft_loss
from ..algorithms.soft_update import old_adapter_decay
from ..config import ExperimentConfig
from ..experience.rollout import Rollout, SDESampling
from ..models import lora
from ..registry import algorithms
from .credit import modality_terms
from .skeleton import Algorithm, MicroBatch, NoisedRows, Plan, TrainedRows, UpdateBatch, Work, noised_inputs


@algorithms.register("nft")
class DiffusionNFT(Algorithm):
    """Negative-aware fine-tuning: r from group advantages, the NFT loss against the `old` adapter
    at the trained timesteps, then a soft update of `old` (algorithms/nft.py holds the math)."""

    display_name = "DiffusionNFT"
    options_type = NFTOptions

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_nft(cfg)

    @classmethod
    def sde_sampling(cls, cfg: ExperimentConfig) -> SDESampling | None:
        """Rollouts with Flow-GRPO's SDE when algorithm.rollout_sde_noise > 0 (every step but the
        last); the loss reads only their x0."""
        noise = cfg.algorithm.rollout_sde_noise
        return SDESampling(noise, seed=cfg.train.seed) if noise > 0 else None

    def metric_names(self) -> list[str]:
        a, empty = self.options, torch.zeros(0, 1)
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

    def optimality(self, batch: UpdateBatch) -> torch.Tensor:
        """r of this process's samples, [n] ([n, M] per modality): their clipped group advantages
        mapped to [0, 1]."""
        return self.every_optimality(batch)[batch.local]

    def every_optimality(self, batch: UpdateBatch) -> torch.Tensor:
        """r of every process's samples, [N] ([N, M] per modality)."""
        a = self.options
        adv = self.advantages_of(batch, per_group_std=a.per_group_std, per_reward=a.adv_per_reward)
        return optimality_probability(adv, a.adv_clip_max, a.adv_mode)

    def plan(self, batch: UpdateBatch) -> Plan:
        every, mine = self.every_optimality(batch), batch.mine
        r = every[batch.local]
        plan = self.nft_plan(batch.rollout, r, batch.step, mine)
        plan.metrics["r/mean"] = float(r[mine].mean()) if mine.any() else float("nan")
        plan.metrics |= self.credit_metrics(batch, every, centre=0.5)
        return plan

    def nft_plan(self, rollout: Rollout, r: torch.Tensor, step: int, trained: torch.Tensor | None) -> Plan:
        """The NFT loss toward `r` [n] on the `trained` samples (None: all), one pass per trained
        timestep; the noise every sample draws does not depend on which are trained."""
        inputs = noised_inputs(self.learner.cfg, rollout, step, self.options.timestep_choice)
        return Plan(trained, {"r": r, "inputs": inputs}, len(inputs), {"old_decay": self.old_decay(step)})

    def train_on(
        self, rollout: Rollout, r: torch.Tensor, step: int, keep: torch.Tensor | None = None
    ) -> dict[str, float]:
        """One update on the NFT loss toward given `r` [n] (keep: [n] bool, the samples to train on)."""
        return self.run(rollout, step, self.nft_plan(rollout, r, step, keep))

    def nft_gradients(
        self, rollout: Rollout, r: torch.Tensor, step: int, rows: TrainedRows, scale: float = 1.0
    ) -> dict[str, float]:
        """Accumulate `scale` times the NFT loss's gradient over the trained `rows`; returns the loss
        metrics (means over the trained samples)."""
        work = Work.of(rollout, self.nft_plan(rollout, r, step, None), rows, scale)
        return self.accumulate(self.sweep(work))

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        a, learner = self.options, self.learner
        policy, transformer = learner.policy, learner.transformer
        rows = NoisedRows.of(micro)
        x_t, x0, t, cond, w = rows.x_t, rows.x0, rows.t, rows.cond, rows.weight
        with torch.no_grad(), learner.autocast():
            with lora.using_adapter(transformer, lora.OLD):
                v_old = policy.velocity(x_t, t, cond).float()
            v_ref = None
            if a.kl_coef > 0:
                with lora.adapters_disabled(transformer):
                    v_ref = policy.velocity(x_t, t, cond).float()
        with learner.autocast():
            v_theta = policy.velocity(x_t, t, cond)
        r, v_theta = micro.rows("r").to(x0.device), v_theta.float()
        if self.entries is None:
            loss, metrics = nft_loss(
                v_theta, v_old, x_t, x0, t, r, a.beta, a.adv_clip_max, v_ref, a.kl_coef, w
            )
            return loss, {"loss/total": loss.detach(), **metrics}

        def modality_loss(
            _: int, index: torch.Tensor, r_m: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            ref = None if v_ref is None else v_ref[:, index]
            sliced = (v_theta[:, index], v_old[:, index], x_t[:, index], x0[:, index])
            return nft_loss(*sliced, t, r_m, a.beta, a.adv_clip_max, ref, a.kl_coef, w)

        loss, metrics = modality_terms(self.entries, r, a.credit_balance, modality_loss)
        return loss, {"loss/total": loss.detach(), **metrics}

    def old_decay(self, step: int) -> float:
        return old_adapter_decay(self.options.decay_schedule, step + 1)  # after update number step + 1
