"""Generate a batch with the policy and score it: the rollout keeps only x0, condition and grid.

`ExperienceMaker` is the one path from prompts to scored experience (the prompt stream, seeded
noise per prompt group, generation with the rollout weights, decoding, scoring), used by the
trainer, the rollout processes of the async modes, lending and cost measurement.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from ..algorithms.credit import MODALITIES
from ..models.policy import (
    Condition,
    FlowPolicy,
    cat_conditions,
    index_condition,
    modality_entries,
    repeat_condition,
)
from ..named_batch import BatchSchema, NamedBatch
from ..reward import ScoreResult, WeightedReward
from ..runtime.sharding import compute_device
from .guidance import encode_empty, guided
from .sampling import policy_time_grid, sample_ode, sample_sde

if TYPE_CHECKING:
    from ..config import SamplingConfig

_STREAMS = {
    "prompts": 1,
    "rollout": 2,
    "train": 3,
    "eval": 4,
    "preview": 5,
    "distill": 6,
    "answers": 7,
    "sde": 8,
    "completion": 9,
    "sde_window": 10,
}
STATES, BEHAVIOUR_LOGP, SDE_STEPS = "states", "behaviour_logp", "sde_steps"
"""Extras of an SDE rollout: the visited states [N, T, *latent], each step's log-probability under
the weights that sampled it [N, T] and which steps ran the SDE [N, T] (1.0 / 0.0)."""


def step_generator(seed: int, step: int, index: int, stream: str) -> torch.Generator:
    """A generator for one purpose (stream) at one step for one prompt group or slot."""
    key = f"{seed}:{step}:{index}:{_STREAMS[stream]}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)


class PendingExtras:
    """Extras still being made (teacher targets) for consecutive blocks of a step's rows, each block a
    future. `rows` waits only for the blocks the asked rows lie in, so training can start on the
    first chunks while the teacher answers the last; `select` keeps that for a subset of the rows.
    `waited_s` is the time spent waiting, shared by every view of the same blocks."""

    def __init__(
        self,
        blocks: list[tuple[int, int, Future[dict[str, torch.Tensor]]]],
        index: torch.Tensor | None = None,
        clock: list[float] | None = None,
    ) -> None:
        self.blocks = blocks  # (start, stop, future) in the rows of the rollout that made them
        self.index = torch.arange(blocks[-1][1] if blocks else 0) if index is None else index
        self._clock = [0.0] if clock is None else clock

    @property
    def waited_s(self) -> float:
        return self._clock[0]

    def __len__(self) -> int:
        return len(self.index)

    def select(self, index: torch.Tensor) -> PendingExtras:
        return PendingExtras(self.blocks, self.index[index.cpu()], self._clock)

    def _result(self, future: Future[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        if future.done():
            return future.result()
        started = time.perf_counter()
        try:
            return future.result()
        finally:
            self._clock[0] += time.perf_counter() - started

    def rows(self, start: int, stop: int) -> dict[str, torch.Tensor]:
        """The extras of rows start..stop (of this view), waiting for the blocks they lie in."""
        wanted = self.index[start:stop]
        out: dict[str, torch.Tensor] = {}
        for a, b, future in self.blocks:
            inside = (wanted >= a) & (wanted < b)
            if not bool(inside.any()):
                continue
            values = self._result(future)
            if out and set(values) != set(out):
                raise ValueError(f"pending extras disagree between blocks: {sorted(values)} vs {sorted(out)}")
            for k, v in values.items():
                if k not in out:
                    out[k] = v.new_empty((len(wanted), *v.shape[1:]))
                out[k][inside.to(v.device)] = v[(wanted[inside] - a).to(v.device)]
        return out

    def bounds(self) -> list[int]:
        """Rows of this view where a new block starts (besides 0): where training may wait."""
        starts = torch.tensor([a for a, _, _ in self.blocks])
        block = torch.bucketize(self.index, starts, right=True)
        return (torch.nonzero(block[1:] != block[:-1]).flatten() + 1).tolist()


def stream_prompt(prompts: list[str], seed: int, position: int) -> str:
    """The prompt at a position of the data stream: every epoch is a fresh permutation."""
    epoch, offset = divmod(position, len(prompts))
    order = torch.randperm(len(prompts), generator=step_generator(seed, epoch, 0, "prompts"))
    return prompts[int(order[offset])]


@dataclass(frozen=True)
class SDESampling:
    """How an algorithm that needs log-probabilities (Flow-GRPO) samples: the SDE's noise level and
    which steps run it: every step but the last (window_size 0), MixGRPO's sliding window, or
    Flow-GRPO-Fast's window drawn at each step (window_range > 0, keyed by `seed` and the step)."""

    noise_level: float
    window_size: int = 0
    window_stride: int = 1
    window_every: int = 1
    window_range: int = 0
    seed: int = 0
    per_modality: bool = False  # record each modality's log-probability (per-modality credit)

    def steps(self, num_steps: int, step: int) -> torch.Tensor:
        """[num_steps] bool: the steps that run the SDE at training `step` (never the last)."""
        from ..algorithms.flow_grpo import drawn_window, sde_window

        if self.window_size == 0:
            start, stop = 0, num_steps - 1
        elif self.window_range:
            generator = step_generator(self.seed, step, 0, "sde_window")
            start, stop = drawn_window(self.window_size, self.window_range, generator)
        else:  # MixGRPO's window ends before step num_steps - 2, as its max_timesteps = steps - 2 does
            start, stop = sde_window(
                step, num_steps - 2, self.window_size, self.window_stride, self.window_every
            )
        mask = torch.zeros(num_steps, dtype=torch.bool)
        mask[start:stop] = True
        return mask


@dataclass(frozen=True)
class SDEDraw:
    """One generation's SDE: its noise level, which steps run it and each SDE step's z
    [N, number of SDE steps, *latent]."""

    noise_level: float
    steps: torch.Tensor
    step_noise: torch.Tensor
    log_prob_groups: tuple[torch.Tensor, ...] = ()  # entries each log-probability covers (): all


def unusable_samples(rollout: Rollout) -> dict[int, str]:
    """Samples whose recorded log-probabilities or states are not finite: failed, with the reason."""
    out: dict[int, str] = {}
    for name in (BEHAVIOUR_LOGP, STATES):
        values = rollout.extras.get(name)
        if values is None:
            continue
        bad = ~torch.isfinite(values.flatten(1)).all(dim=1)
        for i in bad.nonzero().flatten().tolist():
            out.setdefault(i, f"the sampler's {name.replace('_', ' ')} is not finite (NaN or inf)")
    return out


def with_failures(result: ScoreResult, failures: dict[int, str]) -> ScoreResult:
    """`result` with more failed samples (their total and parts NaN, the reason kept)."""
    if not failures:
        return result
    rows = torch.tensor(sorted(failures))
    total = result.total.clone()
    total[rows] = float("nan")
    parts = {k: v.clone().index_fill_(0, rows, float("nan")) for k, v in result.parts.items()}
    return ScoreResult(total, parts, {**result.failures, **failures})


@dataclass
class Rollout:
    prompts: list[str]  # one per sample
    group_ids: torch.Tensor  # [N] global prompt-group id of each sample
    x0: torch.Tensor  # [N, *latent]
    cond: Condition
    grid: torch.Tensor  # [T + 1] sampler times, 1 -> 0
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    """Per-sample tensors an algorithm attaches (visited states, teacher targets): [N, ...] each."""
    pending: PendingExtras | None = field(default=None, repr=False, compare=False)
    """More extras, still being made: read them with `extras_rows`, or `settle` to wait for all."""

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
            extras={k: v[index.to(v.device)] for k, v in self.extras.items()},
            pending=None if self.pending is None else self.pending.select(index),
        )

    def settle(self) -> Rollout:
        """Wait for the pending extras and merge them into `extras` (in place); returns self."""
        if self.pending is not None:
            self.extras.update(self.pending.rows(0, len(self.pending)))
            self.pending = None
        return self

    def extras_rows(self, part: slice) -> dict[str, torch.Tensor]:
        """The extras of the rows in `part`, waiting only for the pending ones those rows need."""
        ready = {k: v[part] for k, v in self.extras.items()}
        if self.pending is None:
            return ready
        return {**ready, **self.pending.rows(part.start, part.stop)}

    def pending_bounds(self) -> list[int]:
        """Rows where the pending extras' next block starts (empty when nothing is pending)."""
        return [] if self.pending is None else self.pending.bounds()

    def to(self, device: torch.device) -> Rollout:
        """x0 and the condition on `device` (what came from another process is on the CPU)."""
        cond = {k: v.to(device) for k, v in self.cond.items()}
        extras = {k: v.to(device) for k, v in self.extras.items()}
        x0 = self.x0.to(device)
        return Rollout(self.prompts, self.group_ids, x0, cond, self.grid, extras, self.pending)

    SCHEMA = BatchSchema(
        per_sample=("x0", "group_ids"), prefixes=("cond.", "extra."), texts=("prompts",), shared=("grid",)
    )

    def to_named(self) -> NamedBatch:
        """Named CPU tensors for another process (see named_batch.py); pending extras are waited for."""
        self.settle()
        per_sample = {"x0": self.x0.detach().cpu().contiguous(), "group_ids": self.group_ids.cpu()}
        per_sample |= {f"cond.{k}": v.detach().cpu().contiguous() for k, v in self.cond.items()}
        per_sample |= {f"extra.{k}": v.detach().cpu().contiguous() for k, v in self.extras.items()}
        return NamedBatch(per_sample, {"prompts": list(self.prompts)}, {"grid": self.grid.cpu()})

    @classmethod
    def from_named(cls, batch: NamedBatch) -> Rollout:
        """The rollout `to_named` sent; a batch that does not fit the schema is refused."""
        cls.SCHEMA.check(batch, "a rollout")
        t = batch.per_sample
        cond = {k.removeprefix("cond."): v for k, v in t.items() if k.startswith("cond.")}
        extras = {k.removeprefix("extra."): v for k, v in t.items() if k.startswith("extra.")}
        return cls(batch.texts["prompts"], t["group_ids"], t["x0"], cond, batch.shared["grid"], extras)

    @staticmethod
    def cat(parts: list[Rollout]) -> Rollout:
        """One rollout of consecutive parts (their pending extras are waited for)."""
        parts = [r.settle() for r in parts]
        return Rollout(
            prompts=[p for r in parts for p in r.prompts],
            group_ids=torch.cat([r.group_ids for r in parts]),
            x0=torch.cat([r.x0 for r in parts]),
            cond=cat_conditions([r.cond for r in parts]),
            grid=parts[0].grid,
            extras={k: torch.cat([r.extras[k] for r in parts]) for k in parts[0].extras},
        )


def generate(
    policy: FlowPolicy,
    prompts: list[str],
    group_ids: list[int],
    noise: torch.Tensor,
    num_steps: int,
    time_shift: float,
    solver: str,
    record_states: bool = False,
    sde: SDEDraw | None = None,
    cfg_scale: float = 1.0,
) -> Rollout:
    """len(noise) / len(prompts) samples per prompt (consecutive), integrated from `noise`.

    The time grid is the policy's own (`policy_time_grid`): diffusers policies use their
    scheduler's grid, the built-in tiny model the uniform one. Training reuses `Rollout.grid`.
    record_states: keep the states the sampler visited, x_k at grid[k] for k < T, as
    `extras["states"]` [N, T, *latent].
    sde: sample with Flow-GRPO's SDE on its steps (Euler only) and record the states, each step's
    log-probability and the SDE steps (STATES, BEHAVIOUR_LOGP, SDE_STEPS).
    cfg_scale: classifier-free guidance toward each prompt away from the empty one (1: off).
    """
    group_size = len(noise) // len(prompts)
    if group_size * len(prompts) != len(noise):
        raise ValueError(f"{len(noise)} noise samples do not split into groups for {len(prompts)} prompts")
    device = compute_device(policy.transformer)
    cond = repeat_condition(policy.encode_prompts(prompts), group_size)
    cond = {k: v.to(device) for k, v in cond.items()}
    noise = noise.to(device)
    grid = policy_time_grid(policy, num_steps, time_shift)  # the diffusers scheduler's or uniform
    states: list[torch.Tensor] | None = [] if record_states else None
    empty = repeat_condition(encode_empty(policy, device), len(noise)) if cfg_scale != 1.0 else None
    velocity = lambda x, t: guided(policy, x, t.to(device), cond, empty, cfg_scale)  # noqa: E731
    extras: dict[str, torch.Tensor] = {}
    if sde is not None:
        if solver != "euler":
            raise ValueError(f"the SDE sampler steps like euler; sampling.solver={solver} has no SDE form")
        x0, visited, log_probs = sample_sde(
            velocity, noise, grid, sde.noise_level, sde.steps, sde.step_noise, sde.log_prob_groups
        )
        steps = sde.steps.float().to(device).expand(len(noise), -1).contiguous()
        extras = {STATES: visited, BEHAVIOUR_LOGP: log_probs, SDE_STEPS: steps}
    else:
        x0 = sample_ode(velocity, noise, grid, solver, states)
        if states is not None:
            extras = {STATES: torch.stack(states, dim=1)}
    return Rollout(
        prompts=[p for p in prompts for _ in range(group_size)],
        group_ids=torch.tensor(group_ids).repeat_interleave(group_size),
        x0=x0,
        cond=cond,
        grid=grid,
        extras=extras,
    )


def generate_for_eval(
    policy: FlowPolicy, prompts: list[str], noise: torch.Tensor, sampling: SamplingConfig
) -> Rollout:
    """One sample per noise row as a run's evaluation and previews sample: `sampling`'s eval steps,
    time shift, solver and guidance."""
    s = sampling
    ids = list(range(len(prompts)))
    return generate(
        policy, prompts, ids, noise, s.eval_num_steps, s.time_shift, s.solver, cfg_scale=s.cfg_scale
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


class Annotator(Protocol):
    """Per-chunk extras an algorithm needs (teacher_targets.py): `submit` returns a
    future of per-sample tensors; `needs_states` asks generation to record the visited states."""

    needs_states: bool

    def submit(self, rollout: Rollout) -> Future[dict[str, torch.Tensor]]: ...

    def metrics(self) -> dict[str, float]: ...

    def totals(self) -> dict[str, float]: ...


class ExperienceMaker:
    """Scored prompt groups from the policy's rollout weights.

    `rollout_weights()` is a context in which the policy generates with the weights the rollout
    side uses (an algorithm's choice: DiffusionNFT's `old` adapter), `load_rollout_state` loads
    synced ones (on a rollout process); everything random derives from
    (seed, step, prompt group), so where a group is made does not change it.
    """

    def __init__(
        self,
        policy: FlowPolicy,
        reward: WeightedReward,
        prompts: list[str],
        seed: int,
        group_size: int,
        num_steps: int,
        time_shift: float,
        solver: str,
        rollout_chunks: int = 1,
        rollout_weights: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        load_rollout_state: Callable[[dict[str, torch.Tensor]], None] | None = None,
        autocast: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext,
        annotator: Annotator | None = None,
        sde: SDESampling | None = None,
        cfg_scale: float = 1.0,
    ) -> None:
        self.policy, self.reward, self.prompts, self.seed = policy, reward, prompts, seed
        self.sde = sde  # sample with the SDE and record log-probabilities (Flow-GRPO); None: the ODE
        self.cfg_scale = cfg_scale  # classifier-free guidance of the rollouts (1: off)
        self.policy_step = 0  # updates the rollout weights have had: where MixGRPO's window is
        self.annotator = annotator  # an algorithm's per-chunk extras (teacher targets), made alongside
        self.last_pending: PendingExtras | None = None  # the last make_step's extras still being made
        self.group_size, self.num_steps, self.time_shift, self.solver = (
            group_size,
            num_steps,
            time_shift,
            solver,
        )
        self.rollout_chunks = rollout_chunks
        self.rollout_weights = rollout_weights
        self._load_rollout_state = load_rollout_state
        self.autocast = autocast  # generation's precision (precision.py)
        self.generated_at = 0.0  # perf_counter when the last make_step finished generating
        self.batch_type = Rollout  # what it makes (to_named / from_named at process boundaries)

    def load_rollout_state(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load rollout weights a trainer synced (what its algorithm's `rollout_state` sent)."""
        if self._load_rollout_state is None:
            raise RuntimeError("this experience maker was built without a way to load rollout weights")
        self._load_rollout_state(tensors)

    def prompt_at(self, position: int) -> str:
        """The prompt at a position of the data stream: every epoch is a fresh permutation."""
        return stream_prompt(self.prompts, self.seed, position)

    def generate(
        self, prompts: list[str], group_ids: list[int], noise: torch.Tensor, num_steps: int, key_step: int = 0
    ) -> Rollout:
        """len(noise) / len(prompts) samples per prompt with the rollout weights (an SDE's step noise
        keyed by (seed, key_step, prompt group), its window by `policy_step`)."""
        record = self.annotator is not None and self.annotator.needs_states
        sde = self._sde_draw(group_ids, len(noise) // len(prompts), num_steps, key_step)
        with self.rollout_weights(), self.autocast():
            return generate(
                self.policy,
                prompts,
                group_ids,
                noise,
                num_steps,
                self.time_shift,
                self.solver,
                record,
                sde,
                self.cfg_scale,
            )

    def _sde_draw(
        self, group_ids: list[int], group_size: int, num_steps: int, key_step: int
    ) -> SDEDraw | None:
        if self.sde is None:
            return None
        steps = self.sde.steps(num_steps, self.policy_step)
        shape = (group_size, int(steps.sum()), *self.policy.latent_shape)
        step_noise = torch.cat(
            [torch.randn(shape, generator=step_generator(self.seed, key_step, g, "sde")) for g in group_ids]
        )
        groups = ()
        if self.sde.per_modality:
            entries = modality_entries(self.policy)
            if entries is None:
                raise ValueError(
                    f"per-modality credit: {type(self.policy).__name__} does not say where its video and "
                    "audio lie (modality_entries); use algorithm.credit=global"
                )
            groups = tuple(entries[m] for m in MODALITIES)
        return SDEDraw(self.sde.noise_level, steps, step_noise, groups)

    def make_group(self, position: int) -> tuple[Rollout, ScoreResult]:
        """The prompt group at stream `position`, generated and scored (noise keyed by position)."""
        gen = step_generator(self.seed, 0, position, "rollout")
        noise = torch.randn((self.group_size, *self.policy.latent_shape), generator=gen)
        rollout = self.generate([self.prompt_at(position)], [position], noise, self.num_steps)
        annotated = None if self.annotator is None else self.annotator.submit(rollout)
        result = with_failures(score(self.policy, self.reward, rollout), unusable_samples(rollout))
        if annotated is not None:
            rollout.extras.update(annotated.result())
        return rollout, result

    def make_step(self, step: int, prompts: list[str], group_ids: list[int]) -> tuple[Rollout, ScoreResult]:
        """A step's prompt groups (noise keyed by step and group), generated in `rollout_chunks`
        chunks, each scored (in the background, or by a reward server) while the next generates."""
        k = self.group_size
        self.policy_step = step
        generators = [step_generator(self.seed, step, g, "rollout") for g in group_ids]
        noise = torch.stack([torch.randn((k, *self.policy.latent_shape), generator=g) for g in generators])
        chunks = [c.tolist() for c in torch.arange(len(prompts)).chunk(self.rollout_chunks)]
        parts, pending, annotations, offset = [], [], [], 0
        for chunk in chunks:
            part = self.generate(
                [prompts[i] for i in chunk],
                [group_ids[i] for i in chunk],
                noise[chunk].flatten(0, 1),
                self.num_steps,
                step,
            )
            if self.annotator is not None:
                annotations.append((offset, offset + len(part), self.annotator.submit(part)))
            with torch.no_grad():
                pending.append(self.reward.submit(self.policy.decode(part.x0), part.prompts))
            parts.append(part)
            offset += len(part)
        self.generated_at = time.perf_counter()
        rollout = Rollout.cat(parts)
        if annotations:  # not waited for here: training takes each chunk's targets when it gets there
            rollout.pending = self.last_pending = PendingExtras(annotations)
        return rollout, with_failures(cat_results([f.result() for f in pending]), unusable_samples(rollout))

    def metrics(self, pending: PendingExtras | None = None) -> dict[str, float]:
        """The annotator's step metrics (teacher seconds, waiting, routing), if there is one; the wait
        is training's for `pending` (default: the last make_step's extras)."""
        if self.annotator is None:
            return {}
        pending = self.last_pending if pending is None else pending
        waited = 0.0 if pending is None else pending.waited_s  # teacher time not hidden
        return {"teacher/wait_s": waited, **self.annotator.metrics()}

    def totals(self) -> dict[str, float]:
        """The annotator's counters since this maker started (teacher seconds, the teacher's replica
        counters): what a rollout process reports to the trainer with each group."""
        totals = getattr(self.annotator, "totals", None)  # optional for a registered algorithm's annotator
        return totals() if callable(totals) else {}
