"""A discrete-event simulation of the execution modes on a virtual clock.

The rollout and trainer pools take their decisions with the runtime's buffer (`ReplayBuffer`) and
scheduler functions (`scheduler.py`); only time is virtual, advanced by a `CostModel`. The
result is what a run would report: seconds per trained prompt, idle fractions per pool and
reason, the staleness histogram, buffer depth over time, switches and syncs.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from ...buffer import Group, ReplayBuffer
from .. import scheduler
from .costs import CostModel, Workload
from .pick import pick_mode

MODES = ("colocated", "separate", "hybrid")


@dataclass
class SimResult:
    mode: str
    seconds: float
    trained_prompts: int
    idle_s: dict[str, Counter[str]] = field(default_factory=dict)  # pool -> reason -> replica-seconds
    pool_replicas: dict[str, int] = field(default_factory=dict)
    buffer: dict[str, Any] = field(default_factory=dict)
    depth: list[tuple[float, int]] = field(default_factory=list)  # (time, groups waiting)
    switches: int = 0
    syncs: int = 0
    first_step_s: float = 0.0  # when the first optimizer step ended
    first_step_prompts: int = 0

    @property
    def seconds_per_prompt(self) -> float:
        return self.seconds / self.trained_prompts if self.trained_prompts else float("inf")

    @property
    def steady_seconds_per_prompt(self) -> float:
        """Without the first step (an async mode's buffer filling up)."""
        prompts = self.trained_prompts - self.first_step_prompts
        return (self.seconds - self.first_step_s) / prompts if prompts > 0 else float("inf")

    def idle_fraction(self) -> dict[str, dict[str, float]]:
        out = {}
        for pool, reasons in self.idle_s.items():
            total = self.pool_replicas[pool] * self.seconds
            out[pool] = {r: round(s / total, 4) for r, s in sorted(reasons.items())} if total else {}
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "seconds": round(self.seconds, 3),
            "trained_prompts": self.trained_prompts,
            "seconds_per_prompt": round(self.seconds_per_prompt, 4),
            "steady_seconds_per_prompt": round(self.steady_seconds_per_prompt, 4),
            "idle_fraction": self.idle_fraction(),
            "buffer": self.buffer,
            "switches": self.switches,
            "weight_syncs": self.syncs,
            "max_buffer_depth": max((d for _, d in self.depth), default=0),
        }


def simulate(mode: str, costs: CostModel, work: Workload, steps: int) -> SimResult:
    """Run `steps` optimizer steps of `mode` on a virtual clock."""
    if mode == "colocated":
        return _colocated(costs, work, steps)
    if mode in ("separate", "hybrid"):
        return _Async(costs, work, lend=mode == "hybrid").run(steps)
    raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")


def _colocated(costs: CostModel, work: Workload, steps: int) -> SimResult:
    """Every replica generates its share of the step's groups, then all train together."""
    per_replica_groups = -(-work.prompts_per_step // work.replicas)  # the slowest replica's share
    samples = per_replica_groups * work.group_size
    step_s = costs.gen(samples) + costs.train(samples) + costs.colocated_phase_s
    result = SimResult("colocated", steps * step_s, steps * work.prompts_per_step)
    result.first_step_s, result.first_step_prompts = step_s, work.prompts_per_step
    result.pool_replicas = {"all": work.replicas}
    result.idle_s = {"all": Counter({"switching": work.replicas * steps * costs.colocated_phase_s})}
    result.buffer = {"staleness_histogram": {"0": steps * work.prompts_per_step * work.group_size}}
    return result


class _Async:
    """separate (and hybrid, with lending): rollout replicas feed the buffer, the trainer pool drains it."""

    def __init__(self, costs: CostModel, work: Workload, lend: bool) -> None:
        self.costs, self.work, self.lend = costs, work, lend
        self.buffer: ReplayBuffer[None] = ReplayBuffer(work.capacity, work.max_staleness)
        self.now = 0.0
        self.events: list[tuple[float, int, str, int]] = []
        self.order = itertools.count()
        self.trainer_version = 0
        self.published = 0
        self.versions = [0] * work.rollout_replicas
        self.calls = [0] * work.rollout_replicas  # generation calls started per rollout replica
        self.published_offset = 0  # the stream offset sent with the last weights
        self.lent_trained = 0  # lent groups trained (they shift the rollout stream's training versions)
        self.skipped = 0  # stream groups dropped as stale
        self.lent_ids = itertools.count(scheduler.LENT_STREAM_START)
        self.last_train_s: float | None = None  # the last training step's duration, once one ran
        self.in_flight = 0
        self.start_version: dict[int, int] = {}  # rollout replica -> weights version of its current call
        self.lent_version = 0
        self.batch: list[Group[None]] = []
        self.waiting: dict[int, tuple[float, str]] = {}  # rollout replica -> (since, reason)
        self.trainer_waiting_since: float | None = None
        self.idle = {"rollout": Counter(), "trainer": Counter()}
        self.group_ids = itertools.count()
        self.result = SimResult("hybrid" if lend else "separate", 0.0, 0)
        self.rate = scheduler.rollout_rate(costs, work, work.rollout_replicas)

    def at(self, delay: float, kind: str, who: int = 0) -> None:
        heapq.heappush(self.events, (self.now + delay, next(self.order), kind, who))

    def run(self, steps: int) -> SimResult:
        for r in range(self.work.rollout_replicas):
            self.at(0.0, "rollout_ready", r)
        self.at(0.0, "trainer_ready")
        self.steps_left = steps
        while self.steps_left > 0:
            if not self.events:  # nothing can happen any more: this layout cannot make progress
                raise RuntimeError(
                    f"the simulated {self.result.mode} run stalled at {self.now:.1f} s, {self.steps_left} "
                    f"steps left, {len(self.buffer)} groups waiting: check sync_every, max_staleness and "
                    "the buffer size"
                )
            self.now, _, kind, who = heapq.heappop(self.events)
            getattr(self, kind)(who)
        for since, reason in self.waiting.values():  # rollout replicas still held back at the end
            self.idle["rollout"][reason] += self.now - since
        r = self.result
        r.seconds = self.now
        r.idle_s = self.idle
        r.pool_replicas = {"rollout": self.work.rollout_replicas, "trainer": self.work.trainer_replicas}
        r.buffer = self.buffer.report()
        return r

    # ------------------------------------------------------------------ rollout pool
    def rollout_ready(self, r: int) -> None:
        if self.published > self.versions[r]:  # apply the newest weights between batches
            self.versions[r] = self.published
            self.idle["rollout"]["weight_sync"] += self.costs.sync_s
            self.at(self.costs.sync_s, "rollout_ready", r)
            return
        g, w = self.work.groups_per_generation, self.work
        last_position = (self.calls[r] * w.rollout_replicas + r) * g + g - 1  # this call's newest group
        if not self.buffer.has_room(g, self.in_flight):
            self.waiting[r] = (self.now, "buffer_full")
        elif w.on_stale == "wait" and not scheduler.may_make_group(
            last_position, self.versions[r], w.max_staleness, w.prompts_per_step, self.published_offset
        ):
            self.waiting[r] = (self.now, "staleness_gate")
        else:
            self.calls[r] += 1
            self.in_flight += g
            self.at(self.costs.gen(g * w.group_size), "rollout_done", r)
            self.start_version[r] = self.versions[r]

    def rollout_done(self, r: int) -> None:
        self.put_groups(self.work.groups_per_generation, self.start_version[r])
        self.in_flight -= self.work.groups_per_generation
        self.rollout_ready(r)

    def put_groups(self, count: int, version: int, lent: bool = False) -> None:
        for _ in range(count):
            group_id = next(self.lent_ids if lent else self.group_ids)
            self.buffer.put(Group(group_id, version, self.work.group_size, arrived=self.now))
        self.result.depth.append((self.now, len(self.buffer)))
        if self.trainer_waiting_since is not None:
            self.idle["trainer"]["waiting_for_data"] += self.work.trainer_replicas * (
                self.now - self.trainer_waiting_since
            )
            self.trainer_waiting_since = None
            self.at(0.0, "trainer_ready")

    def wake_rollout(self) -> None:
        for r, (since, reason) in list(self.waiting.items()):
            self.idle["rollout"][reason] += self.now - since
            del self.waiting[r]
            self.at(0.0, "rollout_ready", r)

    # ------------------------------------------------------------------ trainer pool
    def trainer_ready(self, _: int = 0) -> None:
        batch = self.buffer.take(self.work.prompts_per_step, self.trainer_version)
        stale_stream = sum(g.group_id < scheduler.LENT_STREAM_START for g in self.buffer.last_stale)
        if stale_stream:  # the runtime sends the new offset at once (no weights): so do we
            self.skipped += stale_stream
            self.published_offset = scheduler.stream_offset(self.skipped, self.lent_trained)
            self.wake_rollout()
        if batch is not None:
            self.batch = batch
            self.result.depth.append((self.now, len(self.buffer)))
            self.wake_rollout()  # room in the buffer
            samples = -(-self.work.prompts_per_step // self.work.trainer_replicas) * self.work.group_size
            self.last_train_s = self.costs.train(samples)
            self.at(self.last_train_s, "trainer_done")
            return
        g, w = self.work.groups_per_generation, self.work
        lent = w.trainer_replicas * g
        lent_call_s = self.costs.gen(g * w.group_size) + 2 * self.costs.switch_s
        if (
            self.lend
            and self.buffer.has_room(lent, self.in_flight)
            and scheduler.should_lend(
                len(self.buffer),
                self.in_flight,
                w.prompts_per_step,
                w.lend_threshold,
                lent_call_s,
                self.rate,
                self.last_train_s,
            )
        ):
            self.result.switches += 2  # lend, then reclaim
            self.idle["trainer"]["switching"] += self.work.trainer_replicas * 2 * self.costs.switch_s
            self.in_flight += lent
            self.lent_version = self.trainer_version
            self.at(self.costs.switch_s + self.costs.gen(g * self.work.group_size), "lent_done")
            return
        self.trainer_waiting_since = self.now

    def lent_done(self, _: int = 0) -> None:
        lent = self.work.trainer_replicas * self.work.groups_per_generation
        self.in_flight -= lent
        self.put_groups(lent, self.lent_version, lent=True)
        self.at(self.costs.switch_s, "trainer_ready")  # reclaimed

    def trainer_done(self, _: int = 0) -> None:
        self.trainer_version += 1
        self.buffer.mark_trained(self.batch, self.trainer_version - 1)
        self.result.trained_prompts += len(self.batch)
        if not self.result.first_step_prompts:
            self.result.first_step_s, self.result.first_step_prompts = self.now, len(self.batch)
        self.lent_trained += sum(g.group_id >= scheduler.LENT_STREAM_START for g in self.batch)
        self.steps_left -= 1
        delay = 0.0
        if scheduler.should_sync(self.trainer_version, self.work.sync_every):
            self.published = self.trainer_version
            self.published_offset = scheduler.stream_offset(self.skipped, self.lent_trained)
            self.result.syncs += 1
            self.idle["trainer"]["weight_sync"] += self.work.trainer_replicas * self.costs.sync_s
            delay = self.costs.sync_s
        self.wake_rollout()  # the staleness gate may open
        self.at(delay, "trainer_ready")


def simulate_settings(
    costs: CostModel,
    workloads: dict[str, Workload],
    lengths: dict[str, float],
    steps: int = 20,
    margin: float = 0.1,
) -> dict[str, Any]:
    """Each mode at each length setting, and the mode auto would pick there by its own rule
    (pick.pick_mode on steady seconds per prompt, with `margin`: execution.auto_switch_margin).
    `workloads` has a "colocated" and an "async" (separate, hybrid) layout, or one "all" for both."""
    report: dict[str, Any] = {}
    for setting, length in lengths.items():
        c = costs.with_length(length)
        rows, steady = {}, {}
        for mode in MODES:
            work = workloads.get("colocated" if mode == "colocated" else "async", workloads.get("all"))
            if work is None:
                raise ValueError("workloads needs 'colocated' and 'async' layouts, or 'all'")
            result = simulate(mode, c, work, steps)
            rows[mode], steady[mode] = result.as_dict(), result.steady_seconds_per_prompt
        fastest = min(steady, key=steady.get)
        report[setting] = {
            "length": length,
            "modes": rows,
            "auto_picks": pick_mode(steady, margin),
            "fastest_steady": fastest,
            "margin": margin,
        }
    return report


def format_report(report: dict[str, Any], reported: dict[str, dict[str, float]] | None = None) -> str:
    """A table: seconds per trained prompt per mode and setting, the steady ones (without the first
    step; what auto picks by), and the published figures if any."""
    lines = [f"{'setting':<10}{'length':>8}  " + "".join(f"{m:>12}" for m in MODES) + f"{'auto picks':>14}"]
    for setting, row in report.items():
        cells = "".join(f"{row['modes'][m]['seconds_per_prompt']:>12.3f}" for m in MODES)
        lines.append(f"{setting:<10}{row['length']:>8g}  {cells}{row['auto_picks']:>14}")
        steady = "".join(f"{row['modes'][m]['steady_seconds_per_prompt']:>12.3f}" for m in MODES)
        lines.append(f"{'  steady':<18}  {steady}")
        if reported and setting in reported:
            published = "".join(f"{reported[setting].get(m, float('nan')):>12.3f}" for m in MODES)
            lines.append(f"{'  reported':<18}  {published.replace('nan', '  -')}")
    return "\n".join(lines)
