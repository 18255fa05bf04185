"""auto: measure the job's unit costs in the running processes, predict each mode with the
simulator, and run the fastest.

Every process times the same warm-up (execution/measure.py) at the same time, so the costs carry
the contention the real run will see (processes sharing cores or a node); the costs are averaged
over processes, so every process computes the same prediction and picks the same mode. The
measurement uses a throw-away copy of the policy, freed before the run builds its own.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch
import torch.distributed as dist

from ..config import ConfigError, ExperimentConfig
from .costs import CostModel, Workload
from .measure import costs_to_json, measure_costs
from .simulate import MODES, simulate

PREDICTED_STEPS = 20


def workloads(cfg: ExperimentConfig, processes: int) -> dict[str, Workload]:
    """The colocated layout (every process) and the async one (rollout_replicas of them generate)."""
    ex = cfg.execution
    common = {
        "replicas": processes,
        "prompts_per_step": cfg.data.prompts_per_step,
        "group_size": cfg.data.group_size,
        "sync_every": ex.sync_every,
        "max_staleness": ex.max_staleness,
        "on_stale": ex.on_stale,
        "buffer_groups": ex.buffer_groups,
        "lend_threshold": ex.lend_threshold,
    }
    rollout = processes - 1  # separate/hybrid run one trainer process for now
    return {"colocated": Workload(**common), "async": Workload(**common, rollout_replicas=rollout)}


def predict(costs: CostModel, cfg: ExperimentConfig, processes: int) -> dict[str, float]:
    """Steady seconds per trained prompt (after the first step) of each mode for `processes`
    processes; inf for a mode that cannot run this layout (colocated needs prompts_per_step
    divisible by the processes; an async layout may stall)."""
    work = workloads(cfg, processes)
    out = {}
    for mode in MODES:
        if mode == "colocated" and cfg.data.prompts_per_step % processes:
            out[mode] = float("inf")
            continue
        layout = work["colocated" if mode == "colocated" else "async"]
        try:
            out[mode] = simulate(mode, costs, layout, PREDICTED_STEPS).steady_seconds_per_prompt
        except RuntimeError:  # the simulated layout stalled
            out[mode] = float("inf")
    return out


def _mean_over_processes(costs: CostModel) -> CostModel:
    """Every cost (and measured point) averaged over processes: the same model everywhere."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return costs
    fields = dataclasses.asdict(costs)
    scalars = [n for n, v in fields.items() if not isinstance(v, tuple)]
    tables = [n for n, v in fields.items() if isinstance(v, tuple)]
    flat = [float(fields[n]) for n in scalars] + [y for n in tables for _, y in fields[n]]
    values = torch.tensor(flat, dtype=torch.float64)
    dist.all_reduce(values)
    values = (values / dist.get_world_size()).tolist()
    out: dict[str, Any] = dict(zip(scalars, values[: len(scalars)], strict=True))
    rest = iter(values[len(scalars) :])
    for name in tables:
        out[name] = tuple((x, next(rest)) for x, _ in fields[name])
    return CostModel(**out)


def choose_mode(
    cfg: ExperimentConfig, processes: int, device: torch.device | None = None
) -> tuple[ExperimentConfig, dict[str, Any]]:
    """The config with execution.mode set to the predicted fastest mode, and what led there."""
    if processes < 2:
        report = {"picked": "colocated", "why": "one process: the async modes need at least 2"}
        return _with_mode(cfg, "colocated"), report
    start = time.perf_counter()
    steps = cfg.sampling.num_steps
    costs = measure_costs(
        cfg, steps, steps, repeats=cfg.execution.auto_repeats, replicas=processes, device=device
    )
    costs = _mean_over_processes(costs)
    gc.collect()
    predicted = predict(costs, cfg, processes)
    picked = min(predicted, key=predicted.get)
    if predicted[picked] == float("inf"):
        raise ConfigError(
            f"auto: no execution mode can run this layout ({processes} processes, "
            f"prompts_per_step={cfg.data.prompts_per_step}); see odrl simulate"
        )
    report = {
        "picked": picked,
        "predicted_s_per_prompt": {m: round(v, 4) for m, v in predicted.items()},
        "measured_costs": costs_to_json(costs),
        "warmup_s": round(time.perf_counter() - start, 2),
        "processes": processes,
    }
    return _with_mode(cfg, picked, processes), report


def _with_mode(cfg: ExperimentConfig, mode: str, processes: int = 1) -> ExperimentConfig:
    ex = dataclasses.replace(cfg.execution, mode=mode, rollout_replicas=max(1, processes - 1))
    return dataclasses.replace(cfg, execution=ex)
