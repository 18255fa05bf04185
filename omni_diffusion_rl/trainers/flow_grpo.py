"""Flow-GRPO and MixGRPO on the shared loop (algorithms/flow_grpo.py holds the math).

The rollout side samples with the SDE (the `old` adapter) and records the states it visited, each
step's log-probability and which steps ran the SDE (experience/rollout.py: STATES, BEHAVIOUR_LOGP,
SDE_STEPS). The update recomputes the log-probability of each recorded transition with the trained
adapter on a `timestep_fraction` of the sample's SDE steps, takes the clipped PPO loss against the
recorded (behaviour) log-probability with group-normalised advantages (samples at exactly 0 left
out, as flow_grpo does) and, with kl_coef > 0, flow_grpo's KL term of its step to the base model's
(in flow_grpo's units), accumulates every chosen step of every sample and makes one optimizer step;
`old` then follows the trained adapter. In the async modes a sample may be a few versions old: its
ratio is against the log-probability its own weights recorded, and `grpo/logp_gap` reports how far
the trained policy has moved from them.

MixGRPO (`sde_window_size` > 0): the SDE runs only on a window of steps scheduled as MixGRPO's
(it moves `sde_window_stride` steps every `sde_window_every` updates, shrinks at the end, is empty
once, then rolls back), the ODE elsewhere, and only the window's steps are trained. Flow-GRPO-Fast
(`sde_window_range` > 0): the window's start is drawn at each step instead.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..algorithm_options import FlowGRPOOptions, check_flow_grpo
from ..algorithms.flow_grpo import clipped_policy_loss, sde_step, step_kl
from ..config import ExperimentConfig
from ..experience.guidance import encode_empty, guided
from ..experience.rollout import BEHAVIOUR_LOGP, SDE_STEPS, STATES, Rollout, SDESampling, step_generator
from ..models import lora
from ..models.policy import Condition, index_condition, repeat_condition
from ..registry import algorithms
from .credit import modality_terms
from .skeleton import (
    Algorithm,
    MicroBatch,
    Plan,
    UpdateBatch,
    Work,
    finite_if_dropped,
    micro_batches,
)


@algorithms.register("flow_grpo")
class FlowGRPO(Algorithm):
    """Flow-GRPO: the clipped policy gradient on the SDE's per-step log-probabilities (see the
    module docstring)."""

    display_name = "Flow-GRPO"
    trains_guided = True  # with sampling.cfg_scale > 1 the rollouts and the loss use the guided velocity
    options_type = FlowGRPOOptions

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_flow_grpo(cfg)

    @classmethod
    def sde_sampling(cls, cfg: ExperimentConfig) -> SDESampling | None:
        a = cfg.algorithm
        return SDESampling(
            a.sde_noise,
            a.sde_window_size,
            a.sde_window_stride,
            a.sde_window_every,
            a.sde_window_range,
            cfg.train.seed,
            per_modality=a.credit == "per_modality",
        )

    def metric_names(self) -> list[str]:
        names = ["loss/total", "loss/policy", "grpo/clip_fraction", "grpo/approx_kl", "grpo/logp_gap"]
        return sorted([*names, "loss/kl"] if self.options.kl_coef > 0 else names)

    def update(self, batch: UpdateBatch) -> dict[str, float]:
        """`updates_per_batch` optimizer steps, each on its share of the step's prompt groups (in
        the order of their ids, dealt round-robin); the metrics are their means weighted by samples.
        When nothing is trainable (every advantage 0, or MixGRPO's empty window) it makes no
        optimizer step and logs grpo/skipped."""
        plan, parts = self.plan(batch), self.options.updates_per_batch
        trainable = plan.data.pop("trainable")  # [N], every process's samples: all agree
        if not bool(trainable.any()):
            return {**plan.metrics, "grpo/skipped": 1.0}
        if parts == 1:
            return self.run(batch.rollout, batch.step, plan)
        _, order = torch.unique(batch.groups, return_inverse=True)  # every process agrees on it
        deal = order % parts
        totals: dict[str, float] = {}
        trained = 0
        for j in range(parts):
            count = int((trainable & (deal == j)).sum())
            if count == 0:  # every process skips it alike: nothing of this share is trainable
                continue
            sub = Plan(plan.trained & (deal[batch.local] == j), plan.data, plan.passes, plan.metrics)
            for name, value in self.run(batch.rollout, batch.step, sub).items():
                totals[name] = totals.get(name, 0.0) + value * count
            trained += count
        return {name: value / trained for name, value in totals.items()}

    def plan(self, batch: UpdateBatch) -> Plan:
        """The trainable samples (scored, in a group of 2 or more, with an SDE step, and with an
        advantage other than 0 under drop_zero_advantage), their advantages and trained steps."""
        rollout, cfg = batch.rollout, self.learner.cfg
        missing = [k for k in (STATES, BEHAVIOUR_LOGP, SDE_STEPS) if k not in rollout.extras]
        if missing:
            raise ValueError(f"a flow_grpo rollout lacks {', '.join(missing)} (sampled without the SDE?)")
        steps = trained_sde_steps(rollout, cfg.train.seed, batch.step, cfg.algorithm.timestep_fraction)
        adv_all = self.advantages_of(batch, per_group_std=self.options.per_group_std)
        nonzero = adv_all != 0
        if nonzero.ndim == 2:  # per modality: a sample is dropped when every modality's advantage is 0
            nonzero = nonzero.any(dim=1)
        trainable = batch.keep & nonzero if self.options.drop_zero_advantage else batch.keep.clone()
        if steps.shape[1] == 0:  # MixGRPO's window is empty at this step: no step to train
            trainable[:] = False
        adv, mine = adv_all[batch.local], trainable[batch.local]
        metrics = {
            "grpo/adv_abs": float(adv[batch.mine].abs().mean()) if batch.mine.any() else float("nan"),
            "grpo/trained_share": float(trainable.sum() / batch.keep.sum()) if batch.keep.any() else 0.0,
        }
        metrics |= self.credit_metrics(batch, adv_all, centre=0.0)
        if self.options.sde_window_size:
            sde = rollout.extras[SDE_STEPS]
            metrics["grpo/window_start"] = float(sde[0].argmax()) if len(rollout) and sde.any() else -1.0
        return Plan(mine, {"adv": adv, "steps": steps, "trainable": trainable}, metrics=metrics)

    def sweep(self, work: Work) -> Iterator[MicroBatch]:
        """One pass per trained step: every micro-batch of samples at their j-th chosen step."""
        rollout = work.rollout
        if not len(rollout):
            return
        device = rollout.x0.device
        grid = rollout.grid.to(device)
        chosen = work.data["steps"].to(device)
        for part in micro_batches(len(rollout), self.learner.cfg.train.micro_batch_size):
            w = work.weight(part, device)
            states = finite_if_dropped(rollout.extras[STATES][part].to(device), w)
            logp = finite_if_dropped(rollout.extras[BEHAVIOUR_LOGP][part].to(device), w)
            rows = torch.arange(len(states), device=device)
            cond = index_condition(rollout.cond, part)
            empty = self.empty_condition(len(states), device)
            for j in range(chosen.shape[1]):
                k = chosen[part, j]
                data = {
                    "x": states[rows, k],
                    "x_next": states[rows, k + 1],
                    "t": grid[k],
                    "t_next": grid[k + 1],
                    "logp_old": logp[rows, k],
                    "cond": cond,
                    "empty": empty,
                }
                yield MicroBatch(work, part, j, chosen.shape[1], data)

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        a, learner, d = self.options, self.learner, micro.data
        policy, t_cap = learner.policy, float(micro.work.rollout.grid[1])
        x, x_next = d["x"].float(), d["x_next"].float()
        scale = learner.cfg.sampling.cfg_scale
        with learner.autocast():
            v = guided(policy, d["x"], d["t"], d["cond"], d["empty"], scale, a.detach_uncond)
        groups = () if self.entries is None else tuple(self.entries.values())
        step = (d["t"], d["t_next"], a.sde_noise, t_cap)
        _, logp, mean, _ = sde_step(v.float(), x, *step, x_next=x_next, groups=groups)
        w = micro.weight(x.device)
        adv = micro.rows("adv").to(x.device)
        mean_ref = None
        if a.kl_coef > 0:
            with torch.no_grad(), learner.autocast(), lora.adapters_disabled(learner.transformer):
                v_ref = guided(policy, d["x"], d["t"], d["cond"], d["empty"], scale)
            _, _, mean_ref, _ = sde_step(v_ref.float(), x, *step, x_next=x_next)

        def policy_term(
            column: int, index: slice | torch.Tensor, adv: torch.Tensor
        ) -> tuple[torch.Tensor, dict[str, Any]]:
            """The clipped loss (and KL) of the entries `index`, whose log-probs are `column`'s."""
            mine, old = (logp, d["logp_old"]) if not groups else (logp[:, column], d["logp_old"][:, column])
            loss, metrics = clipped_policy_loss(mine, old, adv, a.clip_range, a.adv_clip_max, w)
            if mean_ref is not None:
                kl = step_kl(
                    mean[:, index], mean_ref[:, index], d["t"], a.sde_noise, t_cap
                )  # flow_grpo's units
                kl = (kl if w is None else w * kl).mean()
                metrics["loss/kl"] = kl.detach()
                loss = loss + a.kl_coef * kl
            return loss, metrics

        if self.entries is None:
            loss, metrics = policy_term(0, slice(None), adv)
        else:
            loss, metrics = modality_terms(self.entries, adv, a.credit_balance, policy_term)
        return loss, {"loss/total": loss.detach(), **metrics}

    _empty_row: Condition | None = None

    def empty_condition(self, count: int, device: torch.device) -> Condition | None:
        """The empty prompt's condition for `count` samples when guidance is on (None: off)."""
        if self.learner.cfg.sampling.cfg_scale == 1.0:
            return None
        if self._empty_row is None:  # encoded once: a text encoder's pass is not free
            self._empty_row = encode_empty(self.learner.policy, device)
        return repeat_condition(self._empty_row, count)


def trained_sde_steps(rollout: Rollout, seed: int, step: int, fraction: float) -> torch.Tensor:
    """[N, K]: each sample's trained steps, the first `fraction` of its SDE steps in a random order
    keyed by (seed, step, prompt group); K = max(1, int(SDE steps * fraction)), the same for all
    (0 when no step ran the SDE: MixGRPO's window at its empty place)."""
    sde = rollout.extras[SDE_STEPS].cpu() > 0
    counts = sde.sum(dim=1)
    if len(rollout) and bool((counts != counts[0]).any()):
        raise ValueError(
            f"the samples of a flow_grpo batch ran different numbers of SDE steps: {counts.tolist()}"
        )
    num_train = max(1, int(int(counts[0]) * fraction)) if len(rollout) and int(counts[0]) else 0
    chosen, generators = [], {}
    for i, group in enumerate(rollout.group_ids.tolist()):
        gen = generators.setdefault(group, step_generator(seed, step, group, "train"))
        candidates = sde[i].nonzero().flatten()
        chosen.append(candidates[torch.randperm(len(candidates), generator=gen)[:num_train]])
    return torch.stack(chosen) if chosen else torch.zeros(0, num_train, dtype=torch.long)
