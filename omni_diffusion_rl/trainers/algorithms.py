"""What the trainer learns with: an `Algorithm` turns a step's scored experience into one update.

The trainer (and every execution mode) owns the experience, its gathering over processes and the
accounting of dropped samples; an algorithm receives the step's rewards, prompt groups and trainable
mask, computes its own learning signal, runs the backward passes on this process's samples and calls
`learner.apply_gradients` once. It also says which weights the rollout side generates with
(`rollout_weights`), what a weight sync carries (`rollout_state` / `load_rollout_state`) and what a
checkpoint holds (`checkpoint_tensors` / `load_checkpoint_tensors`). The defaults are the two-adapter
layout of the LoRA policies (generate with `old`, train `trained`), which both algorithms here use.

Algorithms are registered by name (`algorithm.name`). Adding one: subclass `Algorithm`, implement
`metric_names` and `update`, register it with `@algorithms.register("name")`, and select it with
`algorithm.name=name`. RAFT below is the example.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, fields
from typing import Any

import torch

from ..algorithms.advantages import group_advantages, optimality_probability
from ..algorithms.distill import distillation_loss
from ..algorithms.nft import flow_matching_loss, nft_loss
from ..algorithms.soft_update import old_adapter_decay
from ..config import DistillConfig, ExperimentConfig, NFTConfig, RAFTConfig
from ..models import lora
from ..models.policy import index_condition
from ..registry import algorithms
from ..rollout import Rollout, step_generator
from .learner import Learner


class Algorithm:
    """One update from a step's experience (see the module docstring)."""

    display_name = "training"  # the progress bar's label
    options_type: type | None = None  # its options dataclass (config.py), read from the algorithm section
    trains_answers = False  # True: it trains an answering language model (answer rollouts), not a generator

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        section = learner.cfg.algorithm
        self.options: Any = (
            None
            if self.options_type is None
            else self.options_type(**{f.name: getattr(section, f.name) for f in fields(self.options_type)})
        )
        self._metric_names: list[str] = []

    # ------------------------------------------------------------------ the rollout weights
    @staticmethod
    def rollout_weights(transformer: torch.nn.Module) -> contextlib.AbstractContextManager[object]:
        """A context in which the policy generates with the rollout side's weights."""
        return lora.using_adapter(transformer, lora.OLD)

    @staticmethod
    def rollout_state(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors a weight sync sends to the rollout processes."""
        return lora.adapter_state_dict(transformer, lora.OLD)

    @staticmethod
    def load_rollout_state(transformer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Load what `rollout_state` sent (on a rollout process)."""
        lora.load_adapter_state_dict(transformer, lora.OLD, tensors)

    @classmethod
    def experience_annotator(cls, cfg: ExperimentConfig, policy: Any, sharder: Any = None) -> Any:
        """What generation must attach to each chunk for this algorithm (rollout.Annotator: teacher
        targets for distillation), built in every process that makes experience (`sharder`: the
        training processes shard, sharding.Sharder); None: nothing."""
        return None

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """The weights a checkpoint holds (the optimizer state is the trainer's)."""
        return lora.nft_adapter_tensors(self.learner.transformer)

    def load_checkpoint_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        lora.load_nft_adapter_tensors(self.learner.transformer, tensors)

    # ------------------------------------------------------------------ learning
    def metric_names(self) -> list[str]:
        """The loss metrics `update` logs, averaged over processes by trained samples."""
        raise NotImplementedError

    def loss_metric_names(self) -> list[str]:
        """metric_names(), computed once."""
        if not self._metric_names:
            self._metric_names = self.metric_names()
        return self._metric_names

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


def noised_inputs(
    cfg: ExperimentConfig, rollout: Rollout, step: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(t, noise, x_t) per trained timestep: `timestep_fraction` of the sampler grid (t > 0), in a
    random order per sample, x_t forward-noised from x0 with fresh noise. Every draw is keyed by
    (seed, step, prompt group), so it does not depend on how groups spread over processes."""
    train_times = rollout.grid[:-1]
    num_train = max(1, int(len(train_times) * cfg.algorithm.timestep_fraction))
    k = cfg.data.group_size
    orders, noises = [], []
    for group_id in rollout.group_ids[::k].tolist():
        gen = step_generator(cfg.train.seed, step, group_id, "train")
        orders += [torch.randperm(len(train_times), generator=gen) for _ in range(k)]
        noises.append(torch.randn((num_train, k, *rollout.x0.shape[1:]), generator=gen))
    order = torch.stack(orders)
    all_noise = torch.cat(noises, dim=1).to(rollout.x0.device)
    inputs = []
    for j in range(num_train):
        t = train_times[order[:, j]].to(rollout.x0.device)
        t_b = t.view(-1, *([1] * (rollout.x0.ndim - 1)))
        inputs.append((t, all_noise[j], (1 - t_b) * rollout.x0 + t_b * all_noise[j]))
    return inputs


@algorithms.register("nft")
class DiffusionNFT(Algorithm):
    """Negative-aware fine-tuning: r from group advantages, the NFT loss against the `old` adapter,
    then a soft update of `old` (algorithms/nft.py holds the math)."""

    display_name = "DiffusionNFT"
    options_type = NFTConfig

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

    def update(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        a = self.options
        adv = torch.zeros(len(rewards))
        adv[keep] = group_advantages(rewards[keep], groups[keep], per_group_std=a.per_group_std)
        r = optimality_probability(adv[local], a.adv_clip_max, a.adv_mode)
        metrics = self.train_on(rollout, r, step, keep[local])
        metrics["r/mean"] = float(r[keep[local]].mean()) if keep[local].any() else float("nan")
        return metrics

    def train_on(
        self, rollout: Rollout, r: torch.Tensor, step: int, keep: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Gradient of the NFT loss over a random subset of the sampler's timesteps, then one step.

        keep: [N] bool, the samples to train on (the others were dropped); the noise every sample
        draws does not depend on which are dropped. A process left with none still joins the
        gradient average, with weight 0; the caller skips the step when no process has any.
        """
        a, learner = self.options, self.learner
        rows = trained_rows(keep, len(rollout), learner.sharded)
        learner.begin_update(rows.trained, rows.passes(len(rollout)))
        sums = self.nft_gradients(rollout, r, step, rows)
        out = learner.weighted_mean_over_ranks(sums, float(rows.trained), self.loss_metric_names())
        learner.apply_gradients(out, weight=float(rows.trained))
        decay = old_adapter_decay(a.decay_schedule, step + 1)  # this was update number step + 1
        lora.soft_update_old(learner.transformer, decay)
        out["old_decay"] = decay
        return out

    def nft_gradients(
        self, rollout: Rollout, r: torch.Tensor, step: int, rows: TrainedRows, scale: float = 1.0
    ) -> dict[str, float]:
        """Accumulate `scale` times the NFT loss's gradient over the trained `rows`; returns the loss
        metrics (means over the trained samples)."""
        a, learner = self.options, self.learner
        policy, transformer = learner.policy, learner.transformer
        inputs = noised_inputs(learner.cfg, rollout, step)
        if rows.index is not None:
            rollout, r = rollout.select(rows.index), r[rows.index]
            dev = rows.index.to(rollout.x0.device)
            inputs = [(t[dev], noise[dev], x_t[dev]) for t, noise, x_t in inputs]
        r = r.to(rollout.x0.device)
        weight = None if rows.weight is None else rows.weight.to(rollout.x0.device)
        sums: dict[str, float] = {}
        parts = micro_batches(len(rollout), learner.cfg.train.micro_batch_size)
        for t_all, _, x_all in inputs if len(rollout) else []:
            for part in parts:  # the same gradient as one pass: each part's mean weighted by its share
                share = (part.stop - part.start) / len(rollout)
                t, cond = t_all[part], index_condition(rollout.cond, part)
                w = None if weight is None else weight[part]
                x_t, x0 = finite_if_dropped(x_all[part], w), finite_if_dropped(rollout.x0[part], w)
                with torch.no_grad(), learner.autocast():
                    with lora.using_adapter(transformer, lora.OLD):
                        v_old = policy.velocity(x_t, t, cond).float()
                    v_ref = None
                    if a.kl_coef > 0:
                        with lora.adapters_disabled(transformer):
                            v_ref = policy.velocity(x_t, t, cond).float()
                with learner.autocast():
                    v_theta = policy.velocity(x_t, t, cond)
                loss, metrics = nft_loss(
                    v_theta.float(),
                    v_old,
                    x_t,
                    x0,
                    t,
                    r[part],
                    a.beta,
                    a.adv_clip_max,
                    v_ref,
                    a.kl_coef,
                    w,
                )
                scaled = loss if scale == 1.0 else loss * scale
                learner.backward(scaled * share / len(inputs))
                for name, value in {"loss/total": loss.detach(), **metrics}.items():
                    sums[name] = sums.get(name, 0.0) + float(value) * share / len(inputs)
        return sums


@dataclass
class DistillOptions(NFTConfig, DistillConfig):
    """What on-policy distillation reads: its own options and, for nft_coef > 0, DiffusionNFT's."""


def state_weights(grid: torch.Tensor, weighting: str) -> torch.Tensor:
    """[T] weight of the state at each sampler time: 1 (uniform), or dt_k^2 (the transition-mean form
    of an Euler step), scaled to mean 1 so that the learning rate keeps its meaning."""
    if weighting == "uniform":
        return torch.ones(len(grid) - 1)
    dt2 = (grid[:-1] - grid[1:]).float() ** 2
    return dt2 / dt2.mean()


def trained_state_order(cfg: ExperimentConfig, rollout: Rollout, step: int) -> torch.Tensor:
    """[N, T]: each sample's states in a random order keyed by (seed, step, prompt group); the first
    timestep_fraction of them are trained."""
    steps, k = len(rollout.grid) - 1, cfg.data.group_size
    orders = []
    for start in range(0, len(rollout), k):
        gen = step_generator(cfg.train.seed, step, int(rollout.group_ids[start]), "train")
        orders += [torch.randperm(steps, generator=gen) for _ in range(min(k, len(rollout) - start))]
    return torch.stack(orders)


@algorithms.register("distill")
class OnPolicyDistillation(DiffusionNFT):
    """On-policy distillation: the student samples its own trajectories (the rollout weights), a
    frozen teacher gives velocity targets on the states they visited (or on the student's x0
    forward-noised), made alongside generation (teacher_targets.py) and carried with each group;
    loss = weighted mean over states of mean_d (v_student - v_teacher)^2, plus nft_coef times the
    DiffusionNFT loss. With nft_coef 0 the rollout adapter follows the trained one every step."""

    display_name = "distillation"
    options_type = DistillOptions

    @classmethod
    def experience_annotator(cls, cfg: ExperimentConfig, policy: Any, sharder: Any = None) -> Any:
        from ..teacher_targets import TeacherTargets, make_checked_teacher

        teacher = make_checked_teacher(cfg, policy, sharder)
        # A teacher sharded on GPUs answers on the main thread: its all-gathers and the policy's, on
        # two NCCL communicators from two threads, could interleave in another order on each
        # process, which NCCL does not allow (gloo on CPU does).
        in_process = not cfg.teacher.urls
        nccl_shards = in_process and sharder is not None and sharder.active and sharder.device.type == "cuda"
        overlap = cfg.teacher.overlap and not nccl_shards
        return TeacherTargets(teacher, cfg.algorithm.distill_states, cfg.train.seed, overlap=overlap)

    def metric_names(self) -> list[str]:
        names = ["loss/distill", "loss/total"]
        if self.options.nft_coef > 0:
            names += [f"nft/{n}" for n in super().metric_names()]
        return sorted(names)

    def update(
        self,
        rollout: Rollout,
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        a, learner = self.options, self.learner
        rows = trained_rows(keep[local], len(rollout), learner.sharded)
        order = trained_state_order(learner.cfg, rollout, step)  # keyed by group, before drops
        kept = rollout if rows.index is None else rollout.select(rows.index)
        order = order if rows.index is None else order[rows.index]
        learner.begin_update(rows.trained, rows.passes(len(rollout)))
        sums: dict[str, float] = {}
        if a.nft_coef > 0:  # first: it needs no teacher targets, so the teacher gets more time
            adv = torch.zeros(len(rewards))
            adv[keep] = group_advantages(rewards[keep], groups[keep], per_group_std=a.per_group_std)
            r = optimality_probability(adv[local], a.adv_clip_max, a.adv_mode)
            nft = self.nft_gradients(rollout, r, step, rows, scale=a.nft_coef)
            sums |= {f"nft/{k}": v for k, v in nft.items()}
        sums |= self.distill_gradients(kept, order, rows.weight)
        sums["loss/total"] = sums["loss/distill"] + a.nft_coef * sums.get("nft/loss/total", 0.0)
        out = learner.weighted_mean_over_ranks(sums, float(rows.trained), self.loss_metric_names())
        learner.apply_gradients(out, weight=float(rows.trained))
        decay = old_adapter_decay("copy" if a.nft_coef == 0 else a.decay_schedule, step + 1)
        lora.soft_update_old(learner.transformer, decay)
        out["old_decay"] = decay
        return out

    def distill_gradients(
        self, rollout: Rollout, order: torch.Tensor, sample_weight: torch.Tensor | None = None
    ) -> dict[str, float]:
        """Accumulate the velocity-matching loss's gradient at the trained states: the first
        timestep_fraction of each sample's `order` [N, T], each sample times its `sample_weight`
        (None: 1). Sample-major, in the order the chunks were made: a chunk whose teacher targets are
        still pending is waited for when reached."""
        from ..teacher_targets import STATES, TEACHER_V

        a, learner = self.options, self.learner
        if not len(rollout):
            return {"loss/distill": 0.0}
        device = rollout.x0.device
        grid = rollout.grid.to(device)
        weights = state_weights(rollout.grid, a.distill_weighting).to(device)
        order = order.to(device)
        num_train = max(1, int(order.shape[1] * learner.cfg.algorithm.timestep_fraction))
        parts = micro_batches(len(rollout), learner.cfg.train.micro_batch_size)
        parts = split_at(parts, rollout.pending_bounds())
        total = 0.0
        for part in parts:
            extras = rollout.extras_rows(part)
            missing = [k for k in (STATES, TEACHER_V) if k not in extras]
            if missing:
                lacks = ", ".join(missing)
                raise ValueError(f"a distillation rollout lacks {lacks} (made without a teacher?)")
            row_weight = None if sample_weight is None else sample_weight[part].to(device)
            states = finite_if_dropped(extras[STATES].to(device), row_weight)
            targets = finite_if_dropped(extras[TEACHER_V].to(device), row_weight)
            rows = torch.arange(len(states), device=device)
            cond = index_condition(rollout.cond, part)
            share = (part.stop - part.start) / len(rollout)
            for j in range(num_train):
                index = order[part, j]
                with learner.autocast():
                    v = learner.policy.velocity(states[rows, index], grid[index], cond)
                weight = weights[index] if row_weight is None else weights[index] * row_weight
                loss = distillation_loss(v.float(), targets[rows, index], weight)
                learner.backward(loss * share / num_train)
                total += float(loss.detach()) * share / num_train
        return {"loss/distill": total}


@algorithms.register("raft")
class RewardRankedFineTuning(Algorithm):
    """RAFT / rejection-sampling fine-tuning: the `raft_keep` best trainable samples of each prompt
    group are fine-tuned on with the plain flow-matching loss at the trained timesteps; the rollout
    weights then follow the trained adapter (`old` := trained after every step)."""

    display_name = "RAFT"
    options_type = RAFTConfig

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
        learner = self.learner
        best = best_of_each_group(rewards, groups, keep, self.options.raft_keep)
        inputs = noised_inputs(learner.cfg, rollout, step)  # drawn for every sample: independent of the pick
        rows = trained_rows(best[local], len(rollout), learner.sharded)
        chosen = rollout if rows.index is None else rollout.select(rows.index)
        weight = None if rows.weight is None else rows.weight.to(rollout.x0.device)
        learner.begin_update(rows.trained, rows.passes(len(rollout)))
        total = 0.0
        parts = micro_batches(len(chosen), learner.cfg.train.micro_batch_size)
        for t, noise, x_t in inputs if len(chosen) else []:
            if rows.index is not None:
                dev = rows.index.to(rollout.x0.device)
                t, noise, x_t = t[dev], noise[dev], x_t[dev]
            for part in parts:
                share = (part.stop - part.start) / len(chosen)
                w = None if weight is None else weight[part]
                x_part = finite_if_dropped(x_t[part], w)
                with learner.autocast():
                    v_theta = learner.policy.velocity(x_part, t[part], index_condition(chosen.cond, part))
                noise_part, x0_part = finite_if_dropped(noise[part], w), finite_if_dropped(chosen.x0[part], w)
                loss = flow_matching_loss(v_theta.float(), noise_part, x0_part, w)
                learner.backward(loss * share / len(inputs))
                total += float(loss.detach()) * share / len(inputs)
        out = learner.weighted_mean_over_ranks(
            {"loss/flow_matching": total, "loss/total": total}, float(rows.trained), self.loss_metric_names()
        )
        learner.apply_gradients(out, weight=float(rows.trained))
        lora.soft_update_old(learner.transformer, old_adapter_decay("copy", step + 1))
        out["raft/trained_samples"] = float(best.sum())
        return out


@dataclass(frozen=True)
class TrainedRows:
    """Which of a process's samples its passes run over, and what each weighs. Unsharded, dropped
    samples are left out; sharded, every process runs the same passes over all of its samples
    (FSDP gathers each block in lockstep) and a dropped one weighs 0, the others N / trained so
    that the batch mean is the mean over the trained samples."""

    index: torch.Tensor | None  # the rows the passes run over (None: all)
    weight: torch.Tensor | None  # [rows] each sample's weight in the batch mean (None: 1)
    trained: int  # the samples trained on

    def passes(self, count: int) -> int:
        """How many samples the passes run over, of `count`."""
        return count if self.index is None else len(self.index)


def trained_rows(keep: torch.Tensor | None, count: int, sharded: bool) -> TrainedRows:
    """The rows of `count` samples to run passes over when `keep` [count] (None: all) says which
    are trained."""
    if keep is None or bool(keep.all()):
        return TrainedRows(None, None, count)
    trained = int(keep.sum())
    if not sharded:
        return TrainedRows(keep.nonzero().flatten(), None, trained)
    weight = keep.float() * (count / trained) if trained else torch.zeros(count)
    return TrainedRows(None, weight, trained)


def finite_if_dropped(values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """`values` [B, ...] with the rows of weight 0 replaced by zeros (weight None: unchanged): a
    dropped sample still runs its passes when sharded, and a failed one may hold NaN, which times
    its weight 0 would still be NaN."""
    if weight is None:
        return values
    kept = (weight > 0).view(-1, *([1] * (values.ndim - 1))).to(values.device)
    return torch.where(kept, values, torch.zeros((), dtype=values.dtype, device=values.device))


def micro_batches(count: int, size: int) -> list[slice]:
    """`count` samples in consecutive pieces of at most `size` (train.micro_batch_size; 0: one piece)."""
    size = size or count
    return [slice(i, min(i + size, count)) for i in range(0, count, max(size, 1))]


def split_at(parts: list[slice], bounds: list[int]) -> list[slice]:
    """`parts` (consecutive slices) cut again at each row in `bounds`."""
    out = []
    for part in parts:
        cuts = [part.start, *(b for b in bounds if part.start < b < part.stop), part.stop]
        out += [slice(lo, hi) for lo, hi in zip(cuts[:-1], cuts[1:], strict=False)]
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


def algorithm_class(name: str) -> type[Algorithm]:
    """The registered algorithm called `name` (its rollout-weight methods need no instance)."""
    return algorithms.get(name)


def build_algorithm(learner: Learner) -> Algorithm:
    """The algorithm `algorithm.name` names, for this learner."""
    return algorithm_class(learner.cfg.algorithm.name)(learner)
