"""auto: measure the job's unit costs in the running processes, predict each mode with the
simulator, and run the fastest.

Every process times the same warm-up (measure.py) at the same time, so the costs carry
the contention the real run will see (processes sharing cores or a node); the costs are averaged
over processes, so every process computes the same prediction and picks the same mode. The
measurement uses a throw-away copy of the policy, freed before the run builds its own.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...checkpoint import atomic_write_text
from ...config import ConfigError, ExperimentConfig
from ...runtime.distributed import mean_over_processes
from .costs import CostModel, Workload, read_costs_file
from .measure import costs_to_json, measure_costs
from .pick import pick_mode
from .recheck import AutoRecheck, agree_on_switch, rollout_replicas_of, steady_seconds
from .simulate import MODES, SimResult, simulate

PREDICTED_STEPS = 20


def workload(cfg: ExperimentConfig, processes: int, rollout_replicas: int | None = None) -> Workload:
    """The job laid out on `processes`: colocated (no rollout_replicas) or async, with that many
    rollout processes and the rest training."""
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
    return (
        Workload(**common)
        if rollout_replicas is None
        else Workload(**common, rollout_replicas=rollout_replicas)
    )


def rollout_choices(cfg: ExperimentConfig, processes: int) -> list[int]:
    """Rollout process counts an async mode can run with (the trainers get whole shares)."""
    return [r for r in range(1, processes) if cfg.data.prompts_per_step % (processes - r) == 0]


def simulate_modes(costs: CostModel, cfg: ExperimentConfig, processes: int) -> dict[str, SimResult | None]:
    """Each mode simulated for `processes` processes, an async mode at its fastest split into
    rollout and trainer processes (the result's pool_replicas); None for a mode that cannot run
    (colocated needs prompts_per_step divisible by the processes; an async layout may stall)."""
    whole = cfg.data.prompts_per_step % processes == 0
    out: dict[str, SimResult | None] = {}
    for mode in MODES:
        splits: list[int | None] = [*rollout_choices(cfg, processes)]
        if mode == "colocated":
            splits = [None] if whole else []
        results = [simulate_layout(costs, cfg, processes, mode, rollout) for rollout in splits]
        out[mode] = min((r for r in results if r is not None), key=steady_seconds, default=None)
    return out


def simulate_layout(
    costs: CostModel, cfg: ExperimentConfig, processes: int, mode: str, rollout_replicas: int | None
) -> SimResult | None:
    """One mode on one split of the processes (None: the simulated layout stalled)."""
    try:
        return simulate(mode, costs, workload(cfg, processes, rollout_replicas), PREDICTED_STEPS)
    except RuntimeError:
        return None


def predict(costs: CostModel, cfg: ExperimentConfig, processes: int) -> dict[str, float]:
    """Steady seconds per trained prompt (after the first step) of each mode for `processes`
    processes; inf for a mode that cannot run this layout."""
    return {m: steady_seconds(r) for m, r in simulate_modes(costs, cfg, processes).items()}


def _mean_over_processes(costs: CostModel, device: torch.device | None = None) -> CostModel:
    """Every cost (and measured point) averaged over processes: the same model everywhere."""
    fields = dataclasses.asdict(costs)
    scalars = [n for n, v in fields.items() if not isinstance(v, tuple)]
    tables = [n for n, v in fields.items() if isinstance(v, tuple)]
    flat = [float(fields[n]) for n in scalars] + [y for n in tables for _, y in fields[n]]
    values = mean_over_processes(flat, device)
    out: dict[str, Any] = dict(zip(scalars, values[: len(scalars)], strict=True))
    rest = iter(values[len(scalars) :])
    for name in tables:
        out[name] = tuple((x, next(rest)) for x, _ in fields[name])
    return CostModel(**out)


def load_costs(path: str) -> CostModel:
    """execution.auto_costs: unit costs from a costs file (costs.read_costs_file)."""
    try:
        return read_costs_file(path).costs
    except ValueError as e:
        raise ConfigError(
            f"execution.auto_costs={e}. Give the JSON that `odrl simulate --measure` writes, or an auto "
            "run's summary.json; or leave it empty to measure at warm-up"
        ) from e


def choose_mode(
    cfg: ExperimentConfig, processes: int, device: torch.device | None = None
) -> tuple[ExperimentConfig, dict[str, Any], CostModel | None]:
    """The config with execution.mode set to the predicted fastest mode, what led there, and the
    costs it used (measured at warm-up, or from execution.auto_costs)."""
    if processes < 2:
        report = {"picked": "colocated", "why": "one process: the async modes need at least 2"}
        return _with_mode(cfg, "colocated"), report, None
    start = time.perf_counter()
    if cfg.execution.auto_costs:
        costs = load_costs(cfg.execution.auto_costs).with_length(cfg.sampling.num_steps)
    else:
        steps = cfg.sampling.num_steps
        costs = measure_costs(
            cfg, steps, steps, repeats=cfg.execution.auto_repeats, replicas=processes, device=device
        )
        costs = _mean_over_processes(costs, device)
        gc.collect()
    results = simulate_modes(costs, cfg, processes)
    predicted = {m: steady_seconds(r) for m, r in results.items()}
    picked = pick_mode(predicted, cfg.execution.auto_switch_margin)
    if predicted[picked] == float("inf"):
        raise ConfigError(
            f"auto: no execution mode can run this layout ({processes} processes, "
            f"prompts_per_step={cfg.data.prompts_per_step}); see odrl simulate"
        )
    report = {
        "picked": picked,
        "costs_from": cfg.execution.auto_costs or "warm-up",
        "predicted_s_per_prompt": {m: round(v, 4) for m, v in predicted.items()},
        "rollout_replicas": {m: rollout_replicas_of(r) for m, r in results.items() if m != "colocated"},
        "measured_costs": costs_to_json(costs),
        "warmup_s": round(time.perf_counter() - start, 2),
        "processes": processes,
    }
    return _with_mode(cfg, picked, rollout_replicas_of(results[picked])), report, costs


def _with_mode(cfg: ExperimentConfig, mode: str, rollout_replicas: int | None = None) -> ExperimentConfig:
    ex = dataclasses.replace(cfg.execution, mode=mode, rollout_replicas=rollout_replicas or 1)
    return dataclasses.replace(cfg, execution=ex)


RunMode = Callable[[ExperimentConfig, "str | None", "AutoRecheck | None"], "dict[str, Any] | None"]


def run_auto(
    cfg: ExperimentConfig,
    processes: int,
    device: torch.device | None,
    resume: str | None,
    run_mode: RunMode,
) -> dict[str, Any] | None:
    """Pick a mode, run it, and every execution.auto_recheck_every steps re-check the pick with the
    run's own timings (recheck.py); a switch resumes from the checkpoint the old mode just wrote.
    `run_mode(cfg, resume, recheck)` runs one mode on every process (the summary on rank 0)."""
    ex = cfg.execution
    started = time.perf_counter()
    run_cfg, report, costs = choose_mode(cfg, processes, device)
    recheck = None
    if costs is not None and ex.auto_recheck_every:
        recheck = AutoRecheck(
            costs,
            cfg,
            lambda c: simulate_modes(c, cfg, processes),
            lambda c, mode, rollout: simulate_layout(c, cfg, processes, mode, rollout),
            ex.auto_recheck_every,
            ex.auto_switch_margin,
        )
    decisions = dist.new_group(backend="gloo") if recheck is not None else None
    segments: list[dict[str, Any]] = []
    while True:
        if recheck is not None:
            recheck.segment_starting()
        summary = run_mode(run_cfg, resume, recheck)
        if summary is not None:
            segments.append(_segment(run_cfg.execution.mode, summary))
        if recheck is None:
            break
        switch_to, rollout = agree_on_switch(recheck.switch_to, recheck.switch_rollout, decisions)
        if switch_to is None:
            break
        recheck.switching(switch_to, rollout)
        run_cfg = _with_mode(cfg, switch_to, rollout)
        _free_memory()  # the old mode's model before the new one builds its own
        resume = str(Path(cfg.train.output_dir) / "checkpoints")  # the checkpoint the old mode just wrote
    if summary is None:
        return None
    if recheck is not None:
        report["rechecks"] = recheck.log
        report["switches"] = len(segments) - 1
    report["segments"] = segments
    summary["auto"] = report
    if len(segments) > 1:  # the whole run's figures
        summary.update(_whole_run(segments, sum(recheck.measured_switch_s) if recheck else 0.0, cfg))
        summary["seconds"] = round(time.perf_counter() - started, 2)
    if not dist.is_initialized() or dist.get_rank() == 0:
        path = Path(cfg.train.output_dir) / "summary.json"
        atomic_write_text(path, json.dumps(summary, indent=1))  # the last mode's, with the auto block
    return summary


def _whole_run(segments: list[dict[str, Any]], switch_s: float, cfg: ExperimentConfig) -> dict[str, Any]:
    """Seconds per trained prompt over every segment: the switches' time is in the whole-run
    figure, not in the steady one."""
    p = cfg.data.prompts_per_step
    prompts = [(s["to_step"] - s["from_step"]) * p for s in segments]
    out: dict[str, Any] = {"steps_this_run": sum(prompts) // p}
    for key, extra in (("seconds_per_trained_prompt", switch_s), ("steady_seconds_per_trained_prompt", 0.0)):
        if all(key in s for s in segments):
            seconds = sum(s[key] * n for s, n in zip(segments, prompts, strict=True)) + extra
            out[key] = round(seconds / max(1, sum(prompts)), 4)
    return out


def _segment(mode: str, summary: dict[str, Any]) -> dict[str, Any]:
    """One mode's part of the run, from its summary."""
    keys = ("seconds_per_trained_prompt", "steady_seconds_per_trained_prompt")
    end = summary["steps"]
    out = {"mode": mode, "from_step": end - summary["steps_this_run"], "to_step": end}
    out.update({k: summary[k] for k in keys if k in summary})
    if "execution" in summary:
        ex = summary["execution"]
        out.update(rollout_replicas=ex["rollout_replicas"], trainer_replicas=ex["trainer_replicas"])
        out["buffer"] = ex["buffer"]
    return out


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
