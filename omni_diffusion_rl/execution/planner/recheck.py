"""auto's periodic re-check: calibrate the cost model with the run's own step timings, predict every
mode again, and switch when another mode is predicted faster by a margin and the time it saves over
the remaining steps pays for the switch.

The running mode measures only its own batch sizes (colocated: a process's share of a step;
separate/hybrid: one group per rollout call and a trainer process's share of a step), so calibration scales
the warm-up's cost curves by measured / modelled at those sizes: the shape measured at warm-up is
kept, the level follows the run (contention, longer generations, a slower reward). The colocated
phase cost (switching every process between generating and training) is not measured here: a
colocated step times exactly its generation and its training, so it keeps the warm-up's value.

A switch ends the running mode at a step boundary with a checkpoint; the driver (auto.run_auto)
resumes from it in the new mode. Colocated and async checkpoints resume each other.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ...runtime.distributed import broadcast_ints, mean_over_processes
from ...trainers.phases import LoopStart, ProcessPlace, StepPhases
from .costs import CostModel
from .pick import next_mode
from .simulate import MODES, SimResult


@dataclass(frozen=True)
class StepTimings:
    """What one step measured, in the cost model's terms (samples per call, seconds)."""

    gen_samples: float  # samples per generation call (a colocated share, or one rollout group)
    gen_s: float  # seconds per generation call, scoring included
    train_samples: float  # samples of one trainer process's share of a step
    train_s: float


def calibrate(costs: CostModel, timings: StepTimings) -> CostModel:
    """`costs` with generation and training scaled so that they predict `timings` exactly."""
    gen_scale = timings.gen_s / max(costs.gen(timings.gen_samples), 1e-12)
    train_scale = timings.train_s / max(costs.train(timings.train_samples), 1e-12)
    changes: dict[str, Any] = {
        "gen_fixed_s": costs.gen_fixed_s * gen_scale,
        "gen_per_unit_s": costs.gen_per_unit_s * gen_scale,
        "gen_points": tuple((x, y * gen_scale) for x, y in costs.gen_points),
        "train_fixed_s": costs.train_fixed_s * train_scale,
        "train_per_sample_s": costs.train_per_sample_s * train_scale,
        "train_per_unit_s": costs.train_per_unit_s * train_scale,
        "train_points": tuple((x, y * train_scale) for x, y in costs.train_points),
    }
    return dataclasses.replace(costs, **changes)


def mean_timings(window: list[StepTimings]) -> StepTimings:
    """The mean of several steps' timings."""
    return StepTimings(
        gen_samples=statistics.fmean(t.gen_samples for t in window),
        gen_s=statistics.fmean(t.gen_s for t in window),
        train_samples=statistics.fmean(t.train_samples for t in window),
        train_s=statistics.fmean(t.train_s for t in window),
    )


def _timings_of(mode: str, phases: StepPhases, cfg: Any, world_size: int) -> StepTimings | None:
    """One step's timings in the cost model's terms, from the phases the loop timed (None when the
    running mode measured no generation: an async step during which no group arrived)."""
    k, p = cfg.data.group_size, cfg.data.prompts_per_step
    share = p // world_size * k  # world_size: the trainer processes
    if mode == "colocated":
        return StepTimings(share, phases.generate_s + phases.reward_wait_s, share, phases.train_s)
    if phases.rollout_group_s is None:
        return None
    return StepTimings(k, phases.rollout_group_s, share, phases.train_s)


class AutoRecheck:
    """Called by the training loop (Trainer.recheck) with what it measured (trainers/phases.py),
    never with the trainer itself: collects the steps' timings and, every `every` steps, decides
    whether to keep the running mode. One object lives for the whole run; each mode's segment
    reports to it."""

    def __init__(
        self,
        costs: CostModel,
        cfg: Any,
        predict_fn: Any,
        simulate_fn: Any,
        every: int,
        margin: float,
    ) -> None:
        self.costs, self.cfg = costs, cfg
        self.predict_fn = predict_fn  # (costs) -> {mode: SimResult | None} (async: its fastest split)
        self.simulate_fn = simulate_fn  # (costs, mode, rollout_replicas) -> SimResult | None
        self.every, self.margin = every, margin
        self.mode = ""
        self.rollout: int | None = None  # the running mode's rollout processes (async)
        self.window: list[StepTimings] = []
        self.skip_next = True
        self.log: list[dict[str, Any]] = []
        self.switch_to: str | None = None
        self.switch_rollout: int | None = None  # the next mode's rollout processes (async)
        self.decided_at: float | None = None
        self.measured_switch_s: list[float] = []
        self.startup_s = 0.0  # the running mode's start-up (groups, building, loading, start messages)
        self.teardown_s = 0.0  # ending it: its checkpoint, and an async rollout's group in flight
        self.save_s = 0.0  # the largest checkpoint save seen, in any segment
        self.segment_started_at: float | None = None

    def segment_starting(self) -> None:
        """run_auto is about to start a mode (its process groups, then its trainer)."""
        self.segment_started_at = time.perf_counter()

    def loop_started(self, start: LoopStart, ex: Any) -> None:
        """A segment's loop starts in mode `ex.mode` (execution config); its first step, which may
        fill a buffer, is not measured."""
        now = time.perf_counter()
        self.mode, self.rollout = ex.mode, (None if ex.mode == "colocated" else ex.rollout_replicas)
        if self.decided_at is not None:  # the switch just made: from the decision to this loop start
            self.measured_switch_s.append(now - self.decided_at)
            if self.log:  # the process that decided logs
                self.log[-1]["measured_switch_s"] = round(now - self.decided_at, 3)
        self.decided_at = None
        self.switch_to = self.switch_rollout = None
        before_trainer = 0.0  # process groups made before the trainer was built
        if self.segment_started_at is not None:
            before_trainer = max(0.0, start.building_started_at - self.segment_started_at)
        self.startup_s = start.startup_s + before_trainer
        self.window, self.skip_next = [], True

    def after_step(self, phases: StepPhases, place: ProcessPlace) -> bool:
        """Record the step; at a re-check step decide. True: stop the loop here and switch."""
        timings = _timings_of(self.mode, phases, self.cfg, place.world_size)
        if self.skip_next:
            self.skip_next = False
        elif timings is not None:
            self.window.append(timings)
        steps = self.cfg.train.steps
        if phases.step % self.every or phases.step >= steps:
            return False
        if self.mode == "colocated":  # every process is here at the same step: pool the timings
            if not self.window:  # a collective needs every process, each with something to send
                self.window.append(timings)  # type: ignore[arg-type]  # colocated always measures
            pooled = mean_over_processes(list(dataclasses.astuple(mean_timings(self.window))), place.device)
            measured: StepTimings | None = StepTimings(*pooled)
            group = None  # the decision goes to every process
        else:  # async: the trainer leader sees the rollout timings; other trainers follow it
            measured = mean_timings(self.window) if self.window else None
            group = place.decision_group
        self.window = []  # the next re-check sees only the steps after this one, on every process
        self.teardown_s = self._ending_s(phases, measured)
        switch = place.rank == 0 and measured is not None and self._decide(phases.step, measured)
        if place.world_size > 1:  # one process decides (rounding could split the others)
            switch = self._follow_leader(switch, group, place.device)
        return switch

    def _ending_s(self, phases: StepPhases, measured: StepTimings | None) -> float:
        """What ending the running mode at this step costs: the checkpoint it writes then (none
        when this step's regular one is already written; sized by the largest save seen so far),
        and for an async mode the rollout group in flight, which the stop waits for."""
        self.save_s = max(self.save_s, phases.last_save_s)
        every = self.cfg.train.checkpoint_every
        saves = not every or phases.step % every
        in_flight = 0.0 if measured is None or self.mode == "colocated" else measured.gen_s
        return (self.save_s if saves else 0.0) + in_flight

    def _follow_leader(self, switch: bool, group: Any, device: torch.device) -> bool:
        """Rank 0's decision on every process of `group`."""
        mode, rollout = agree_on_switch(
            self.switch_to if switch else None, self.switch_rollout, group, device
        )
        if mode is None:
            return False
        self.switch_to, self.switch_rollout = mode, rollout
        self.decided_at = self.decided_at or time.perf_counter()
        return True

    def switching(self, mode: str, rollout: int | None) -> None:
        """Every process learns the switch (run_auto); the switch is timed from here where it was
        not decided (a rollout process)."""
        self.switch_to, self.switch_rollout = mode, rollout
        self.decided_at = self.decided_at or time.perf_counter()

    def _decide(self, step: int, measured: StepTimings) -> bool:
        """Calibrate, predict every mode (async at its fastest split) and the running layout, and
        keep it or pick the fastest by next_mode's rule."""
        start = time.perf_counter()
        self.costs = calibrate(self.costs, measured)
        results = self.predict_fn(self.costs)
        predicted = {m: steady_seconds(r) for m, r in results.items()}
        best = min(predicted, key=predicted.get)
        target = (best, rollout_replicas_of(results[best]))
        running = (self.mode, self.rollout)
        labels = {running: _label(*running), target: _label(*target)}
        values = {labels[running]: steady_seconds(self.simulate_fn(self.costs, *running))}
        values[labels[target]] = min(predicted[best], values.get(labels[target], float("inf")))
        remaining = (self.cfg.train.steps - step) * self.cfg.data.prompts_per_step
        cost = self.switch_cost(results[best])
        chosen, why = next_mode(values, labels[running], remaining, cost, self.margin)
        self.log.append(
            {
                "step": step,
                "running": labels[running],
                "measured": {k: round(v, 4) for k, v in dataclasses.asdict(measured).items()},
                "predicted_s_per_prompt": {m: round(v, 4) for m, v in predicted.items()},
                "running_predicted_s_per_prompt": round(values[labels[running]], 4),
                "switch_cost_s": round(cost, 3),
                "switch_estimate_parts_s": {
                    "ending": round(self.teardown_s, 3),
                    "starting": round(self.startup_s, 3),
                    "measured_switch": round(max(self.measured_switch_s, default=0.0), 3),
                },
                "next": chosen,
                "why": why,
                "recheck_s": round(time.perf_counter() - start, 4),
            }
        )
        if chosen == labels[running]:
            return False
        (self.switch_to, self.switch_rollout), self.decided_at = target, time.perf_counter()
        return True

    def switch_cost(self, result: SimResult | None) -> float:
        """Seconds a switch costs: measured on an earlier switch, else ending the running mode and
        starting it again; plus the new mode's slower first step (an async buffer filling up)."""
        base = max(self.measured_switch_s) if self.measured_switch_s else self.teardown_s + self.startup_s
        if result is None:
            return base
        steady_step = steady_seconds(result) * self.cfg.data.prompts_per_step
        return base + max(0.0, result.first_step_s - steady_step)


def agree_on_switch(
    switch_to: str | None, rollout: int | None, group: Any = None, device: torch.device | None = None
) -> tuple[str | None, int | None]:
    """Rank 0's decision (the mode to switch to, or None; an async mode's rollout processes) on
    every process of `group`."""
    code = [MODES.index(switch_to) if switch_to else -1, rollout or 0]
    mode, replicas = broadcast_ints(code, group, device)
    return (None, None) if mode < 0 else (MODES[mode], replicas or None)


def rollout_replicas_of(result: SimResult | None) -> int | None:
    """The rollout processes of a simulated async layout (None for colocated)."""
    return None if result is None else result.pool_replicas.get("rollout")


def _label(mode: str, rollout: int | None) -> str:
    """A mode and its split, as logged: `colocated`, or e.g. `separate (1 rollout)`."""
    return mode if rollout is None else f"{mode} ({rollout} rollout)"


def steady_seconds(result: SimResult | None) -> float:
    """A simulated mode's steady seconds per prompt (inf for a layout that cannot run)."""
    return float("inf") if result is None else result.steady_seconds_per_prompt
