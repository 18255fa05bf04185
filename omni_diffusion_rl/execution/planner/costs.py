"""Cost model of one RL job: what generating and training cost on one replica, and the overheads.

Units are seconds of one replica (one device, or one tensor-parallel group). `length` is what makes
a sample long: sampling steps on the diffusion path, response tokens on the LM path.

Generation and training are linear in samples and length, or, when timed at the batch sizes the
modes use (auto's warm-up), interpolated between those measured points (`gen_points`,
`train_points`: (samples, seconds) at `points_length`, scaled by length / points_length): per-sample
cost is not constant across batch sizes (caches, kernels), and a line through two measured points
fits them exactly where a least-squares line with a clamped intercept does not.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...async_layout import buffer_capacity, check_async_layout

MAX_COSTS_FILE_BYTES = 8 << 20


@dataclass(frozen=True)
class CostModel:
    gen_fixed_s: float  # per generation call on one replica (launch, prompt encoding, decode setup)
    gen_per_unit_s: float  # per sample per length unit (one sampling step or one token)
    length: float  # length units per sample
    train_fixed_s: float  # per optimizer step on one trainer replica (all-reduce, optimizer)
    train_per_sample_s: float  # per trained sample on one replica
    sync_s: float  # sending the adapter weights to rollout replicas (trainer leader and each receiver)
    train_per_unit_s: float = 0.0  # per trained sample per length unit (trained timesteps, tokens)
    switch_s: float = 0.0  # lending a trainer replica to rollout, or reclaiming it (hybrid)
    colocated_phase_s: float = 0.0  # colocated: every replica switching generate <-> train, per step
    gen_points: tuple[tuple[float, float], ...] = ()  # measured (samples, seconds) of one call
    train_points: tuple[tuple[float, float], ...] = ()  # measured (samples, seconds) of one step's share
    points_length: float = 0.0  # the length the points were measured at

    def __post_init__(self) -> None:
        for name in ("gen_points", "train_points"):  # JSON gives lists
            points = tuple(sorted((float(x), float(y)) for x, y in getattr(self, name)))
            object.__setattr__(self, name, points)
        numbers = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        bad = {k: v for k, v in numbers.items() if isinstance(v, float | int) and v < 0}
        bad |= {
            k: v for k, v in numbers.items() if isinstance(v, tuple) and any(x <= 0 or y < 0 for x, y in v)
        }
        if bad:
            raise ValueError(f"costs must be >= 0 (and measured sample counts > 0); got {bad}")
        if (self.gen_points or self.train_points) and self.points_length <= 0:
            raise ValueError("gen_points / train_points need the points_length they were measured at")

    def gen(self, samples: int) -> float:
        """Seconds for one replica to generate `samples` samples in one call."""
        if self.gen_points:
            return interpolate(self.gen_points, samples) * self.length / self.points_length
        return self.gen_fixed_s + self.gen_per_unit_s * samples * self.length

    def train(self, samples: int) -> float:
        """Seconds for one trainer replica to take its share (`samples`) of an optimizer step."""
        if self.train_points:
            return interpolate(self.train_points, samples) * self.length / self.points_length
        return self.train_fixed_s + (self.train_per_sample_s + self.train_per_unit_s * self.length) * samples

    def with_length(self, length: float) -> CostModel:
        return dataclasses.replace(self, length=length)


def interpolate(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through sorted (x, y) points; below the first point proportional to it,
    above the last the last segment extended (never below 0)."""
    x0, y0 = points[0]
    if len(points) == 1 or x <= x0:
        return y0 * x / x0
    segment = next((i for i in range(1, len(points) - 1) if x <= points[i][0]), len(points) - 1)
    (xa, ya), (xb, yb) = points[segment - 1], points[segment]
    return max(0.0, ya + (yb - ya) * (x - xa) / (xb - xa))


@dataclass(frozen=True)
class Workload:
    """How the job is laid out; the same for every mode."""

    replicas: int  # processes in all
    prompts_per_step: int  # prompt groups per optimizer step
    group_size: int  # samples per prompt group
    rollout_replicas: int = 1  # separate / hybrid: replicas that only generate
    groups_per_generation: int = 1  # separate / hybrid: prompt groups per generation call of a replica
    sync_every: int = 1  # trainer steps between weight syncs
    max_staleness: int = 1  # trainer versions a sample may lag
    on_stale: str = "wait"  # drop | wait
    buffer_groups: int = 0  # buffer capacity in groups (0: 2 steps' worth)
    lend_threshold: float = (
        1.0  # hybrid: consider lending while the buffer holds less than this share of a step
    )

    def __post_init__(self) -> None:
        if not 0 < self.rollout_replicas < self.replicas:
            raise ValueError(
                f"rollout_replicas must be between 1 and replicas - 1 ({self.replicas - 1}); "
                f"got {self.rollout_replicas}"
            )
        if (
            self.prompts_per_step < 1
            or self.group_size < 1
            or self.groups_per_generation < 1
            or self.sync_every < 1
        ):
            raise ValueError(
                "prompts_per_step, group_size, groups_per_generation and sync_every must be >= 1"
            )
        if self.on_stale not in ("drop", "wait"):
            raise ValueError(f"on_stale must be 'drop' or 'wait'; got {self.on_stale!r}")
        check_async_layout(self.sync_every, self.max_staleness, self.capacity, self.prompts_per_step)

    @property
    def trainer_replicas(self) -> int:
        return self.replicas - self.rollout_replicas

    @property
    def capacity(self) -> int:
        return buffer_capacity(self.buffer_groups, self.prompts_per_step)


# The seed's 4 x H800 comparison (MiniCPM-o 4.5 GSPO audio-visual QA; colocated 4+0 at batch 128 vs
# separate 3 trainer + 1 rollout replicas at batch 120; ~101 natural vs 1024 forced response tokens).
# These unit costs are a least-squares fit (log error) of the seed's four published seconds-per-prompt
# figures (1.522 / 1.663 short, 2.813 / 2.624 long) with this simulator over 20 steps, not measurements:
# a generation call of 8 prompts costs 12.7 s + 1.9e-4 s per prompt-token; training 21.9 s per step +
# (1.65 s + 0.00531 s per token) per prompt; a weight sync 0.81 s; colocated pays 90.6 s per step to
# switch every device between the rollout engine and the trainer (offload, reload, resharding).
SEED_4XH800_COSTS = CostModel(
    gen_fixed_s=12.7,
    gen_per_unit_s=1.9e-4,
    length=101,
    train_fixed_s=21.9,
    train_per_sample_s=1.65,
    sync_s=0.81,
    train_per_unit_s=0.00531,
    switch_s=2.0,
    colocated_phase_s=90.6,
)
SEED_4XH800_LENGTHS = {"short": 101.0, "long": 1024.0}
SEED_4XH800_WORKLOADS = {
    "colocated": Workload(
        replicas=4, prompts_per_step=128, group_size=1, rollout_replicas=1, groups_per_generation=8
    ),
    "async": Workload(
        replicas=4, prompts_per_step=120, group_size=1, rollout_replicas=1, groups_per_generation=8
    ),
}
SEED_4XH800_REPORTED = {
    "short": {"colocated": 1.522, "separate": 1.663},
    "long": {"colocated": 2.813, "separate": 2.624},
}


@dataclass(frozen=True)
class CostsFile:
    """A costs file: the unit costs, and for `odrl simulate` the layouts and lengths to simulate
    (empty when the file has none, e.g. an auto run's summary.json)."""

    costs: CostModel
    workloads: dict[str, Workload] = field(default_factory=dict)
    lengths: dict[str, float] = field(default_factory=dict)


def read_costs_file(path: str | Path) -> CostsFile:
    """The one reader of unit-cost files: what `odrl simulate --measure` writes ({"costs": ...,
    "workloads": ..., "lengths": ...}) or an auto run's summary.json (its auto.measured_costs).
    A ValueError names what is wrong; the file is read with a size bound and never executed."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_COSTS_FILE_BYTES + 1)
        if len(data) > MAX_COSTS_FILE_BYTES:
            raise ValueError(f"larger than {MAX_COSTS_FILE_BYTES >> 20} MiB")
        spec: Any = json.loads(data.decode("utf-8"))
        if not isinstance(spec, dict):
            raise ValueError("not a JSON object")
        auto = spec.get("auto")
        found = spec.get("costs") or (auto.get("measured_costs") if isinstance(auto, dict) else None)
        if not isinstance(found, dict):
            raise ValueError("no 'costs' object and no 'auto.measured_costs'")
        workloads, lengths = spec.get("workloads", {}), spec.get("lengths", {})
        if not isinstance(workloads, dict) or not isinstance(lengths, dict):
            raise ValueError("'workloads' and 'lengths' must be objects")
        return CostsFile(
            CostModel(**found),
            {str(k): Workload(**v) for k, v in workloads.items()},
            {str(k): float(v) for k, v in lengths.items()},
        )
    except (OSError, UnicodeDecodeError, AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{path}: {type(e).__name__}: {e}") from e
