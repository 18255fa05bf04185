"""Advantage weighted matching (algorithm.name=awm) on the shared loop (algorithms/awm.py holds the
math).

Rollouts are on-policy: they sample with the trained adapter (the ODE solver of sampling.solver;
the reference's SA-Solver is not built). An update draws `awm_timesteps` timesteps per sample,
stratified over the sampler's grid and keyed by (seed, step, prompt group), noises each clean
sample afresh there, and takes the advantage-weighted matching loss with its two penalties: to the
base model (adapters off, `kl_coef`) and to a lagged copy of the adapter (`awm_ema_kl_coef`). The
lagged copy is the `old` adapter, which follows the trained one by old <- d old + (1 - d) trained
after every update, d = min(awm_ema_decay_max, awm_ema_decay_per_step * updates so far).
"""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm_options import AWMOptions, check_awm
from ..algorithms.awm import (
    awm_policy_loss,
    ema_decay,
    matching_error,
    matching_log_likelihood,
    stratified_step_indices,
    velocity_gap,
)
from ..config import ExperimentConfig
from ..experience.rollout import Rollout, step_generator
from ..models import lora
from ..registry import algorithms
from .credit import modality_terms
from .skeleton import Algorithm, MicroBatch, NoisedRows, Plan, UpdateBatch


@algorithms.register("awm")
class AdvantageWeightedMatching(Algorithm):
    """AWM: the flow-matching loss on the rollout's samples weighted by their advantages, on-policy
    (see the module docstring)."""

    display_name = "AWM"
    options_type = AWMOptions
    rollout_on_policy = True  # rollouts sample with the trained adapter; `old` is the lagged copy

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_awm(cfg)

    def metric_names(self) -> list[str]:
        a = self.options
        names = ["loss/total", "loss/policy", "awm/matching_error"]
        names += ["loss/kl"] if a.kl_coef > 0 else []
        names += ["loss/ema_kl"] if a.awm_ema_kl_coef > 0 else []
        return sorted(names)

    def plan(self, batch: UpdateBatch) -> Plan:
        a, mine = self.options, batch.mine
        every = self.advantages_of(batch, per_group_std=a.per_group_std)
        adv = every[batch.local]
        inputs = awm_inputs(self.learner.cfg, batch.rollout, batch.step)
        metrics = {
            "awm/adv_abs": float(adv[mine].abs().mean()) if mine.any() else float("nan"),
            "old_decay": self.old_decay(batch.step),
            **self.credit_metrics(batch, every, centre=0.0),
        }
        return Plan(mine, {"adv": adv, "inputs": inputs}, len(inputs), metrics)

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        a, learner = self.options, self.learner
        policy, transformer = learner.policy, learner.transformer
        rows = NoisedRows.of(micro)
        x_t, noise, x0, t, cond, w = rows.x_t, rows.noise, rows.x0, rows.t, rows.cond, rows.weight
        penalties: dict[str, tuple[float, torch.Tensor]] = {}
        with torch.no_grad(), learner.autocast():
            if a.kl_coef > 0:
                with lora.adapters_disabled(transformer):
                    penalties["loss/kl"] = (a.kl_coef, policy.velocity(x_t, t, cond).float())
            if a.awm_ema_kl_coef > 0:
                with lora.using_adapter(transformer, lora.OLD):
                    penalties["loss/ema_kl"] = (a.awm_ema_kl_coef, policy.velocity(x_t, t, cond).float())
        with learner.autocast():
            v = policy.velocity(x_t, t, cond).float()
        adv = micro.rows("adv").to(x0.device)

        def awm_loss(
            _: int, index: slice | torch.Tensor, adv: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            """The policy loss and penalties on the latent's entries `index` with advantages adv [b]."""
            error = matching_error(v[:, index], noise[:, index], x0[:, index])
            log_likelihood = matching_log_likelihood(error, t, a.awm_weighting, a.awm_ghuber_power)
            loss = awm_policy_loss(log_likelihood, adv, a.adv_clip_max, w).float()
            matching = _weighted_mean(error.detach().float(), w)
            metrics = {"loss/policy": loss.detach(), "awm/matching_error": matching}
            for name, (coef, v_other) in penalties.items():
                gap = _weighted_mean(velocity_gap(v[:, index], v_other[:, index]), w)
                metrics[name] = gap.detach()
                loss = loss + coef * gap
            return loss, metrics

        if self.entries is None:
            loss, metrics = awm_loss(0, slice(None), adv)
        else:
            loss, metrics = modality_terms(self.entries, adv, a.credit_balance, awm_loss)
        return loss, {"loss/total": loss.detach(), **metrics}

    def old_decay(self, step: int) -> float:
        a = self.options
        return ema_decay(step + 1, a.awm_ema_decay_max, a.awm_ema_decay_per_step)  # after update step + 1


def _weighted_mean(values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    return values.mean() if weight is None else (weight.to(values.dtype) * values).mean()


def awm_inputs(
    cfg: ExperimentConfig, rollout: Rollout, step: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(t [n], noise, x_t) for each of the `awm_timesteps` passes: each prompt group's timesteps
    stratified over the sampler's grid (all its samples alike, as the reference's batch), fresh noise
    per sample and pass, every draw keyed by (seed, step, prompt group)."""
    a, k = cfg.algorithm, cfg.data.group_size
    grid = rollout.grid[:-1]  # the sampler's times, noisiest first (the reference's timesteps)
    count, skip_first = a.awm_timesteps, a.awm_time_sampling == "discrete_wo_init"
    times, noises = [], []
    for group_id in rollout.group_ids[::k].tolist():
        gen = step_generator(cfg.train.seed, step, group_id, "train")
        index = stratified_step_indices(len(grid), a.timestep_fraction, count, gen, skip_first)
        times.append(grid[index].unsqueeze(1).expand(count, k))
        noises.append(torch.randn((count, k, *rollout.x0.shape[1:]), generator=gen))
    device = rollout.x0.device
    all_t, all_noise = torch.cat(times, dim=1).to(device), torch.cat(noises, dim=1).to(device)
    inputs = []
    for j in range(count):
        t_b = all_t[j].view(-1, *([1] * (rollout.x0.ndim - 1)))
        inputs.append((all_t[j], all_noise[j], (1 - t_b) * rollout.x0 + t_b * all_noise[j]))
    return inputs
