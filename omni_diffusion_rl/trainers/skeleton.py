"""What the trainer learns with: an `Algorithm` turns a step's scored experience into one update.

The trainer (and every execution mode) owns the experience, its gathering over processes and the
accounting of dropped samples; an algorithm receives it as an `UpdateBatch` (the step's rewards,
prompt groups and trainable mask over every process, and this process's samples). `Algorithm.update`
runs the steps every algorithm shares: which samples this process trains on (`TrainedRows`: under
sharding a dropped sample weighs 0 instead of being left out), gradients zeroed and sharded loss
scales set, backward passes over share-weighted micro-batches, the metrics' weighted mean over
processes, one optimizer step, and the soft update of the `old` adapter. An algorithm writes:

- `loss(micro)`: the loss of one micro-batch and its metrics (listed by `metric_names`);
- `plan(batch)`, when it needs more than "train every trainable sample once": which of this
  process's samples it trains on, what its loss reads of each (its learning signal: r,
  advantages, noised inputs), how many passes run over them, and metrics logged as they are;
- hooks for anything special: `old_decay` (the soft update of `old`: DiffusionNFT's schedule),
  `sweep` (the micro-batches: another order or split), `gradients` (several losses in one step),
  `summarize` (metrics of the whole update) and `check` (its options against the rest of the config).

It also says which weights the rollout side generates with (`rollout_weights`), what a weight sync
carries (`rollout_state` / `load_rollout_state`) and what a checkpoint holds (`checkpoint_tensors` /
`load_checkpoint_tensors`). The defaults are the two-adapter layout of the LoRA policies (generate
with `old`, train `trained`), which every algorithm here uses.

Each algorithm owns its options: a dataclass (`options_type`) whose keys sit flat in the config's
algorithm section (algorithm.beta, algorithm.raft_keep; config.algorithm_section routes them by
declaration; the options live in algorithm_options.py). Algorithms are registered by name
(`algorithm.name`), each in its own module: nft.py, distill.py, raft.py (the short example),
flow_grpo.py, awm.py, gspo.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from ..algorithm_options import TIMESTEP_CHOICES, CreditOptions
from ..config import ExperimentConfig
from ..experience.rollout import Rollout, SDESampling, step_generator
from ..models import lora
from ..models.policy import index_condition
from ..registry import algorithms
from ..reward import WeightedReward
from .credit import credit_entries, credit_metrics
from .learner import Learner
from .update_batch import UpdateBatch

__all__ = ["UpdateBatch"]  # an algorithm's update receives one; plug-ins import it from here


# ---------------------------------------------------------------------------------------------
# What an update learns from and how its passes see it


@dataclass
class Plan:
    """What an update trains on this process: `trained` ([n] bool over its samples; None: all),
    what the loss reads of each sample (`data`: tensors with a row per sample, or lists and tuples
    of them, selected along with the samples), the passes over them and metrics logged as they are."""

    trained: torch.Tensor | None = None
    data: dict[str, Any] = field(default_factory=dict)
    passes: int = 1
    metrics: dict[str, float] = field(default_factory=dict)


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


def _select_rows(value: Any, index: torch.Tensor) -> Any:
    """Rows `index` of a tensor, or of each tensor in a list or tuple (nested)."""
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    return type(value)(_select_rows(v, index) for v in value)


@dataclass(frozen=True)
class Work:
    """An update's samples on this process as its passes see them: `rollout` holds the rows the
    passes run over (`rows.index` of the plan's, or all of them), `data` the plan's values for
    those rows, `scale` what the backward pass multiplies the loss by (a loss inside another's)."""

    rollout: Rollout
    rows: TrainedRows
    data: dict[str, Any]
    passes: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, rollout: Rollout, plan: Plan, rows: TrainedRows, scale: float = 1.0) -> Work:
        """The work of `plan` over `rows` of `rollout`."""
        if rows.index is None:
            return cls(rollout, rows, plan.data, plan.passes, scale)
        data = {name: _select_rows(value, rows.index) for name, value in plan.data.items()}
        return cls(rollout.select(rows.index), rows, data, plan.passes, scale)

    def weight(self, part: slice, device: torch.device) -> torch.Tensor | None:
        """[part] each sample's weight in the batch mean on `device` (None: 1)."""
        return None if self.rows.weight is None else self.rows.weight[part].to(device)


@dataclass(frozen=True)
class MicroBatch:
    """One forward and backward pass: rows `part` of the work's rows, in pass `index` of `passes`.
    Its loss weighs share / passes of the update's (`share`: its part of the rows); `data` holds
    what the sweep that made it prepared for the loss (the default sweep: nothing)."""

    work: Work
    part: slice
    index: int = 0
    passes: int = 1
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def share(self) -> float:
        return (self.part.stop - self.part.start) / len(self.work.rollout)

    def rows(self, name: str) -> Any:
        """The plan's per-sample `name` for this micro-batch's rows."""
        return self.work.data[name][self.part]

    def weight(self, device: torch.device) -> torch.Tensor | None:
        """[part] each sample's weight in the batch mean on `device` (None: 1)."""
        return self.work.weight(self.part, device)


LossFn = Callable[[MicroBatch], tuple[torch.Tensor, dict[str, Any]]]


def finite_if_dropped(values: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """`values` [B, ...] with the rows of weight 0 replaced by zeros (weight None: unchanged): a
    dropped sample still runs its passes when sharded, and a failed one may hold NaN, which times
    its weight 0 would still be NaN."""
    if weight is None:
        return values
    kept = (weight > 0).view(-1, *([1] * (values.ndim - 1))).to(values.device)
    return torch.where(kept, values, torch.zeros((), dtype=values.dtype, device=values.device))


@dataclass(frozen=True)
class NoisedRows:
    """A micro-batch's rows of one pass over forward-noised inputs (the plan's data['inputs'][pass]
    = (t, noise, x_t) for every sample): dropped samples' tensors made finite, `weight` their
    weights (None unsharded)."""

    t: torch.Tensor
    noise: torch.Tensor
    x_t: torch.Tensor
    x0: torch.Tensor
    cond: Any
    weight: torch.Tensor | None

    @classmethod
    def of(cls, micro: MicroBatch) -> NoisedRows:
        rollout, part = micro.work.rollout, micro.part
        t, noise, x_t = (v[part] for v in micro.work.data["inputs"][micro.index])
        w = micro.weight(rollout.x0.device)
        return cls(
            t,
            finite_if_dropped(noise, w),
            finite_if_dropped(x_t, w),
            finite_if_dropped(rollout.x0[part], w),
            index_condition(rollout.cond, part),
            w,
        )


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


# ---------------------------------------------------------------------------------------------
# The interface and the shared update


class Algorithm:
    """One update from a step's experience (see the module docstring)."""

    display_name = "training"  # the progress bar's label
    options_type: type | None = None  # its options dataclass: keys flat in the algorithm section
    experience_kind = "media"  # what it learns from (experience_kinds.py): "media", or "answers" (GSPO)
    trains_guided = False  # True: its loss uses sampling.cfg_scale's guided velocity, so rollouts may use it
    uses_teacher = False  # True: its experience waits on a teacher (teacher.one_step_off may hide it)
    rollout_on_policy = False  # True: rollouts sample with the trained adapter, not `old`

    def __init__(self, learner: Learner) -> None:
        self.learner = learner
        section = learner.cfg.algorithm
        self.options: Any = (  # its options dataclass, or the algorithm.options mapping without one
            section.options
            if self.options_type is None
            else self.options_type(**{f.name: getattr(section, f.name) for f in fields(self.options_type)})
        )
        self._metric_names: list[str] = []
        self.entries: dict[str, torch.Tensor] | None = None  # per-modality credit: attach_rewards

    def attach_rewards(self, modalities: Mapping[str, str | None], weights: Mapping[str, float]) -> None:
        """Called once before the first step with what each reward judges and weighs: an algorithm
        with a `credit` option finds its modalities' entries here, or refuses (ConfigError)."""
        if isinstance(self.options, CreditOptions):
            entries = credit_entries(self.options, self.learner.policy, modalities, weights)
            device = self.learner.device  # moved once: the losses index with them at every pass
            self.entries = None if entries is None else {m: i.to(device) for m, i in entries.items()}

    def advantages_of(self, batch: UpdateBatch, **normalising: Any) -> torch.Tensor:
        """Every process's advantages: [N] (global credit) or [N, M] (per modality, in the order of
        `entries`), normalised as `normalising` says (UpdateBatch.advantages' keywords)."""
        if self.entries is None:
            return batch.advantages(**normalising)
        return batch.modality_advantages(list(self.entries), **normalising)

    def credit_metrics(self, batch: UpdateBatch, credit: torch.Tensor, centre: float) -> dict[str, float]:
        """Per-modality credit's metrics over the step's trainable samples (every process's, so
        every process logs the same); none under global credit."""
        if self.entries is None or not batch.keep.any():
            return {}
        return credit_metrics(credit[batch.keep], list(self.entries), centre)

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        """Refuse (ConfigError, naming the keys) options that do not fit the rest of `cfg`; run as
        the config loads. None by default."""

    # ------------------------------------------------------------------ the rollout weights
    @classmethod
    def rollout_adapter(cls) -> str:
        """The adapter rollouts sample with: `old` (default), or the trained one when
        `rollout_on_policy` (AWM, whose `old` is a lagged copy for its penalty)."""
        return lora.TRAINED if cls.rollout_on_policy else lora.OLD

    @classmethod
    def rollout_weights(cls, transformer: torch.nn.Module) -> contextlib.AbstractContextManager[object]:
        """A context in which the policy generates with the rollout side's weights."""
        return lora.using_adapter(transformer, cls.rollout_adapter())

    @classmethod
    def rollout_state(cls, transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The tensors a weight sync sends to the rollout processes."""
        return lora.adapter_state_dict(transformer, cls.rollout_adapter())

    @classmethod
    def load_rollout_state(cls, transformer: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
        """Load what `rollout_state` sent (on a rollout process)."""
        lora.load_adapter_state_dict(transformer, cls.rollout_adapter(), tensors)

    @classmethod
    def sde_sampling(cls, cfg: ExperimentConfig) -> SDESampling | None:
        """How rollouts sample when this algorithm needs per-step log-probabilities (Flow-GRPO's
        SDE); None: the ODE solver (sampling.solver)."""
        return None

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

    # ------------------------------------------------------------------ learning: the shared steps
    def metric_names(self) -> list[str]:
        """The loss metrics an update logs, averaged over processes by trained samples."""
        return ["loss/total"]

    def loss_metric_names(self) -> list[str]:
        """metric_names(), computed once."""
        if not self._metric_names:
            self._metric_names = self.metric_names()
        return self._metric_names

    def update(self, batch: UpdateBatch) -> dict[str, float]:
        """One optimizer step from `batch`."""
        return self.run(batch.rollout, batch.step, self.plan(batch))

    def run(self, rollout: Rollout, step: int, plan: Plan) -> dict[str, float]:
        """The shared steps of update number step + 1: the trained rows, begin_update (zeroed
        gradients, sharded loss scales), the backward passes, the metrics' weighted mean over
        processes, the optimizer step, then the soft update of `old`."""
        learner = self.learner
        rows = trained_rows(plan.trained, len(rollout), learner.sharded)
        learner.begin_update(rows.trained, rows.passes(len(rollout)))
        work = Work.of(rollout, plan, rows)
        sums = self.summarize(work, self.gradients(work))
        out = learner.weighted_mean_over_ranks(sums, float(rows.trained), self.loss_metric_names())
        learner.apply_gradients(out, weight=float(rows.trained))
        lora.soft_update_old(learner.transformer, self.old_decay(step))
        return out | plan.metrics

    def plan(self, batch: UpdateBatch) -> Plan:
        """What this update trains on (default: this process's trainable samples, one pass)."""
        return Plan(batch.mine)

    def gradients(self, work: Work) -> dict[str, float]:
        """Backward passes of the update's losses; their metrics' share-weighted sums."""
        return self.accumulate(self.sweep(work))

    def sweep(self, work: Work) -> Iterator[MicroBatch]:
        """The micro-batches of the loss: `work.passes` passes over the work's rows, each in parts of
        train.micro_batch_size."""
        parts = micro_batches(len(work.rollout), self.learner.cfg.train.micro_batch_size)
        for index in range(work.passes):
            for part in parts:
                yield MicroBatch(work, part, index, work.passes)

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """The loss of one micro-batch (a mean over its samples) and its metrics by name."""
        raise NotImplementedError

    def accumulate(self, micro: Iterable[MicroBatch], loss: LossFn | None = None) -> dict[str, float]:
        """Backpropagate `loss` (default: self.loss) of each micro-batch times its share of the
        update (so that the gradient is that of one pass over every row); the metrics' sums, each
        weighted alike (means over the rows)."""
        loss = loss or self.loss
        sums: dict[str, float] = {}
        for m in micro:
            value, metrics = loss(m)
            scaled = value if m.work.scale == 1.0 else value * m.work.scale
            self.learner.backward(scaled * m.share / m.passes)
            for name, v in metrics.items():
                sums[name] = sums.get(name, 0.0) + float(v) * m.share / m.passes
        return sums

    def summarize(self, work: Work, sums: dict[str, float]) -> dict[str, float]:
        """The update's metrics from the micro-batches' sums, before the mean over processes."""
        return sums

    def old_decay(self, step: int) -> float:
        """The decay d of the soft update old <- d old + (1 - d) trained after update number step + 1
        (default 0: the rollout weights follow the trained adapter, on-policy)."""
        return 0.0


def noised_inputs(
    cfg: ExperimentConfig, rollout: Rollout, step: int, choice: str = "random"
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(t, noise, x_t) per trained timestep: `timestep_fraction` of the sampler grid (t > 0), in a
    random order per sample (choice "random") or the noisiest first (choice "noisiest": every sample
    trains the same, highest-noise times; "noisiest_then_random": so in the first half of
    train.steps, at random after), x_t forward-noised from x0 with fresh noise. Every draw is keyed
    by (seed, step, prompt group), so it does not depend on how groups spread over processes."""
    if choice not in TIMESTEP_CHOICES:
        raise ValueError(f"unknown timestep choice '{choice}'; choose one of {', '.join(TIMESTEP_CHOICES)}")
    train_times = rollout.grid[:-1]
    num_train = max(1, int(len(train_times) * cfg.algorithm.timestep_fraction))
    k = cfg.data.group_size
    orders, noises = [], []
    for group_id in rollout.group_ids[::k].tolist():
        gen = step_generator(cfg.train.seed, step, group_id, "train")
        orders += [torch.randperm(len(train_times), generator=gen) for _ in range(k)]
        noises.append(torch.randn((num_train, k, *rollout.x0.shape[1:]), generator=gen))
    order = torch.stack(orders)
    if choice == "noisiest_then_random":
        choice = "noisiest" if step < cfg.train.steps // 2 else "random"
    if choice == "noisiest":  # the grid runs from the noisiest time down
        order = torch.arange(len(train_times)).expand_as(order)
    all_noise = torch.cat(noises, dim=1).to(rollout.x0.device)
    inputs = []
    for j in range(num_train):
        t = train_times[order[:, j]].to(rollout.x0.device)
        t_b = t.view(-1, *([1] * (rollout.x0.ndim - 1)))
        inputs.append((t, all_noise[j], (1 - t_b) * rollout.x0 + t_b * all_noise[j]))
    return inputs


def algorithm_class(name: str) -> type[Algorithm]:
    """The registered algorithm called `name` (its rollout-weight methods need no instance)."""
    return algorithms.get(name)


def build_algorithm(learner: Learner, reward: WeightedReward | None = None) -> Algorithm:
    """The algorithm `algorithm.name` names, for this learner, told what `reward`'s rewards judge."""
    algorithm = algorithm_class(learner.cfg.algorithm.name)(learner)
    if reward is not None:
        algorithm.attach_rewards(reward.modalities, reward.weights)
    return algorithm
