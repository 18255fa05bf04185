"""Benchmark: what auto's re-check buys when the first pick is wrong, and what it costs when not.

With 2 processes, every run trains the same steps (so the same prompts) of the long setting:
- `colocated`: the fastest fixed mode on this machine (bench modes);
- `auto, wrong prior, no re-check`: auto given a costs file (`wrong_prior`) that makes separate
  look twice as fast as colocated, so it picks separate, and keeps it
  (execution.auto_recheck_every=0);
- `auto, wrong prior, re-check`: the same, re-checking every `every` steps with the run's timings;
- `auto, warm-up, re-check`: the normal path: costs measured at warm-up, re-checked as it runs.
Runs take turns, `repeats` rounds, medians reported: whole-run seconds per trained prompt (the
switch included), steady (without each mode's first step), switches, the measured switch seconds
and the re-checks' own seconds. Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..config import load_config
from .common import DEFAULT_CONFIG, QUIET, launch_training, median, publish, steady_s_per_prompt
from .modes import SETTINGS


def wrong_prior(prompts_per_step: int, group_size: int, length: float, processes: int = 2) -> dict[str, Any]:
    """Costs that make separate (1 rollout process) look twice as fast as colocated: generation
    nearly free, and a trainer taking a whole step in half the time it takes for a colocated share
    (what a prior measured elsewhere may wrongly say)."""
    share = max(1, prompts_per_step // processes) * group_size
    return {
        "costs": {
            "gen_fixed_s": 0.001,
            "gen_per_unit_s": 0.0,
            "length": length,
            "train_fixed_s": 0.0,
            "train_per_sample_s": 0.0,
            "sync_s": 0.0,
            "train_points": [[share, 10.0], [prompts_per_step * group_size, 5.0]],
            "points_length": length,
        }
    }


def run_recheck_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    steps: int = 16,
    every: int = 4,
    repeats: int = 2,
    setting: list[str] | None = None,
) -> dict[str, Any]:
    """Every kind of run `repeats` times on `setting` (default: bench modes' long setting)."""
    output.parent.mkdir(parents=True, exist_ok=True)
    prior = output.with_name(output.stem + "_wrong_prior.json")
    setting = SETTINGS["long"] if setting is None else setting
    job = load_config(config, [*(overrides or []), *setting])
    spec = wrong_prior(job.data.prompts_per_step, job.data.group_size, job.sampling.num_steps)
    prior.write_text(json.dumps(spec, indent=1), encoding="utf-8")
    runs_args = {
        "colocated": ["execution.mode=colocated"],
        "auto, wrong prior, no re-check": [f"execution.auto_costs={prior}", "execution.auto_recheck_every=0"],
        "auto, wrong prior, re-check": [
            f"execution.auto_costs={prior}",
            f"execution.auto_recheck_every={every}",
        ],
        "auto, warm-up, re-check": [f"execution.auto_recheck_every={every}"],
    }
    base = [*(overrides or []), *setting, *QUIET, f"train.steps={steps}", "execution.mode=auto"]
    summaries: dict[str, list[dict[str, Any]]] = {name: [] for name in runs_args}
    for round_index in range(repeats):
        for index, (name, args) in enumerate(runs_args.items()):
            run_dir = output.parent / f"recheck_{index}_{round_index}"
            summaries[name].append(launch_training(config, [*base, f"train.output_dir={run_dir}", *args]))
    rows = {name: _row(runs) for name, runs in summaries.items()}
    reference = rows["colocated"]["whole_s_per_prompt"]
    for row in rows.values():
        row["vs_colocated"] = round(row["whole_s_per_prompt"] / reference - 1, 4)
    result = {"processes": 2, "steps_per_run": steps, "recheck_every": every, "rounds": repeats, "runs": rows}
    publish(result, output, format_table(result), _draw, (7.5, 3.2))
    return result


def _row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over rounds of one kind of run, and what its auto block says."""
    autos = [r.get("auto", {}) for r in runs]
    rechecks = [a.get("rechecks", []) for a in autos]
    switch_s = [r["measured_switch_s"] for checks in rechecks for r in checks if "measured_switch_s" in r]
    return {
        "whole_s_per_prompt": round(median([r["seconds_per_trained_prompt"] for r in runs]), 4),
        "steady_s_per_prompt": round(median([steady_s_per_prompt(r) for r in runs]), 4),
        "whole_each_round": [r["seconds_per_trained_prompt"] for r in runs],
        "modes_each_round": [[s["mode"] for s in a.get("segments", [])] or ["colocated"] for a in autos],
        "switched_at_step": [[s["from_step"] for s in a.get("segments", [])[1:]] for a in autos],
        "measured_switch_s": switch_s,
        "rechecks": [len(checks) for checks in rechecks],
        "recheck_seconds": [round(sum(r["recheck_s"] for r in checks), 4) for checks in rechecks],
    }


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: per kind of run, seconds per prompt against colocated, modes and switches."""
    lines = [
        f"auto's re-check, 2 processes, {result['steps_per_run']} steps per run, re-check every "
        f"{result['recheck_every']}, median of {result['rounds']} rounds (seconds per trained prompt)",
        f"{'run':<32}{'whole':>8}{'vs coloc':>10}{'steady':>8}  modes (switch step, switch s)",
    ]
    for name, row in result["runs"].items():
        modes = " | ".join("->".join(m) for m in row["modes_each_round"])
        steps = ",".join(str(s) for each in row["switched_at_step"] for s in each) or "-"
        switch_s = ",".join(f"{s:.1f}" for s in row["measured_switch_s"]) or "-"
        lines.append(
            f"{name:<32}{row['whole_s_per_prompt']:>8.3f}{row['vs_colocated']:>+10.1%}"
            f"{row['steady_s_per_prompt']:>8.3f}  {modes} ({steps}; {switch_s})"
        )
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    """Whole-run seconds per prompt of each run."""
    names = list(result["runs"])
    axes[0].barh(names, [result["runs"][n]["whole_s_per_prompt"] for n in names])
    axes[0].invert_yaxis()
    axes[0].set_xlabel("seconds per trained prompt (whole run)")
