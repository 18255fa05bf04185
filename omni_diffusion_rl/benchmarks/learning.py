"""Benchmark: the execution modes do not hurt learning.

Each mode trains the same config for the same number of optimizer steps under a 2-process
`accelerate launch`, once per seed, with the held-out evaluation at start and end on. For every
mode the report gives the mean and sample standard deviation over seeds of the held-out reward
after training, its difference to colocated (the on-policy reference), and a verdict:

    within noise  <=>  |mean_mode - mean_colocated| <= 2 * sqrt(std_mode^2/n + std_colocated^2/n)

i.e. the difference of the means is at most two standard errors of that difference. With a single
seed the sample standard deviation is taken as 0, so only an exact tie is within noise.

It also checks the staleness bound: the largest lag (trainer versions) of any trained sample, from
the run's buffer staleness histogram, must be at most the configured `execution.max_staleness` in
every run. Colocated trains only on samples of its current policy: its lag is 0.

Unknown modes fail with the run's own error. Prints a table, writes JSON and a dot-and-bar plot.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config import foreign_option_defaults, load_config
from .common import DEFAULT_CONFIG, QUIET, launch_training, publish

REFERENCE = "colocated"
RULE = "within noise: |mean - mean_colocated| <= 2 * sqrt(std^2/n + std_colocated^2/n_colocated)"


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for a single value)."""
    if not values:
        raise ValueError("no values")
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.fmean(values), std


def noise_band(std: float, n: int, ref_std: float, ref_n: int) -> float:
    """Two standard errors of the difference of two means."""
    return 2.0 * math.sqrt(std**2 / n + ref_std**2 / ref_n)


def within_noise(mean: float, std: float, n: int, ref_mean: float, ref_std: float, ref_n: int) -> bool:
    """|mean - ref_mean| <= 2 * sqrt(std^2/n + ref_std^2/ref_n)."""
    return abs(mean - ref_mean) <= noise_band(std, n, ref_std, ref_n)


def max_lag(histogram: dict[str, int]) -> int:
    """Largest lag with at least one sample in a staleness histogram (lag as a string -> samples)."""
    return max((int(lag) for lag, count in histogram.items() if count > 0), default=0)


def _run_record(mode: str, seed: int, summary: dict[str, Any], prompts: int, bound: int) -> dict[str, Any]:
    """One run's row of the report: held-out rewards, staleness against its bound, speed."""
    execution = summary.get("execution") or {}
    buffer = execution.get("buffer")
    if buffer is not None:
        histogram = {str(k): int(v) for k, v in buffer["staleness_histogram"].items()}
    else:  # colocated: every trained sample comes from the current policy
        histogram = {"0": int(summary["samples"]["trained"])}
    per_prompt = summary.get("seconds_per_trained_prompt", float(summary["seconds"]) / prompts)
    lag = max_lag(histogram)
    return {
        "mode": mode,
        "seed": seed,
        "heldout_reward_before": summary["heldout_reward_before"],
        "heldout_reward_after": summary["heldout_reward_after"],
        "heldout_gain": summary["heldout_gain"],
        "samples_trained": summary["samples"]["trained"],
        "staleness_histogram": histogram,
        "max_lag": lag,
        "max_staleness": bound,
        "staleness_within_bound": lag <= bound,
        "seconds_per_trained_prompt": round(float(per_prompt), 4),
        "hybrid_lends": execution.get("hybrid", {}).get("lends"),  # None outside hybrid
    }


def run_learning_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    modes: Sequence[str] = ("colocated", "separate", "hybrid"),
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 20,
) -> dict[str, Any]:
    """Train every mode with every seed; compare held-out reward after training to colocated.

    A mode written ALGORITHM:MODE (e.g. raft:colocated) runs that algorithm (algorithm.name) instead
    of the config's, so algorithms are compared with the same rule as modes.

    Verdict per mode (stated in the table too): within noise when
    |mean_mode - mean_colocated| <= 2 * sqrt(std_mode^2/n + std_colocated^2/n), with sample standard
    deviations over the seeds. `staleness_within_bound`: the largest trained lag is at most the
    configured execution.max_staleness in every run.
    """
    modes, seeds = list(modes), [int(s) for s in seeds]
    if REFERENCE not in modes:
        raise ValueError(f"the learning bench compares to {REFERENCE}: include it in modes ({modes})")
    if not seeds:
        raise ValueError("give at least one seed")
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    bound = cfg.execution.max_staleness
    prompts = steps * cfg.data.prompts_per_step
    quiet = [o for o in QUIET if not o.startswith("train.eval_at_start_and_end")]
    runs: list[dict[str, Any]] = []
    for mode in modes:
        for seed in seeds:
            algorithm, _, run_mode = mode.rpartition(":")  # "raft:colocated": another algorithm
            run_dir = output.parent / f"learning_{mode.replace(':', '_')}_seed{seed}"
            args = [*overrides, *quiet, f"train.output_dir={run_dir}", f"train.steps={steps}"]
            args += [f"execution.mode={run_mode}", f"train.seed={seed}"]
            if algorithm:  # the config's options of its own algorithm are reset, not refused
                resets = foreign_option_defaults(cfg.algorithm, algorithm)
                args += [
                    f"algorithm.name={algorithm}",
                    *(f"algorithm.{k}={json.dumps(v)}" for k, v in resets.items()),
                ]
            summary = launch_training(config, args)
            runs.append(_run_record(mode, seed, summary, prompts, bound))
            lends = runs[-1]["hybrid_lends"]
            print(
                f"  {mode} seed {seed}: held-out {summary['heldout_reward_before']:.4f} -> "
                f"{summary['heldout_reward_after']:.4f}" + (f" ({lends} lends)" if lends is not None else ""),
                flush=True,
            )
    per_mode = compare_modes(modes, runs)
    result = {
        "processes": 2,
        "steps_per_run": steps,
        "prompts_per_run": prompts,
        "seeds": seeds,
        "modes": modes,
        "max_staleness": bound,
        "rule": RULE,
        "runs": runs,
        "per_mode": per_mode,
        "all_within_noise": all(row["within_noise"] for row in per_mode.values()),
        "staleness_within_bound": all(r["staleness_within_bound"] for r in runs),
    }
    size = (1.6 * len(result["per_mode"]) + 2.0, 3.4)
    publish(result, output, format_table(result), _draw, size)
    return result


def compare_modes(modes: list[str], runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: its seeds' held-out rewards after training, their mean and std, and the verdict
    against colocated by the noise rule (RULE)."""
    per_mode: dict[str, Any] = {}
    for mode in modes:
        mine = [r for r in runs if r["mode"] == mode]
        after = [float(r["heldout_reward_after"]) for r in mine]
        mean, std = mean_std(after)
        per_mode[mode] = {
            "n": len(after),
            "heldout_reward_after": after,
            "mean": mean,
            "std": std,
            "mean_gain": statistics.fmean(float(r["heldout_gain"]) for r in mine),
            "max_lag": max(r["max_lag"] for r in mine),
            "staleness_within_bound": all(r["staleness_within_bound"] for r in mine),
        }
    ref = per_mode[REFERENCE]
    for row in per_mode.values():
        stats = (row["mean"], row["std"], row["n"], ref["mean"], ref["std"], ref["n"])
        row["diff_to_colocated"] = row["mean"] - ref["mean"]
        row["noise_band"] = noise_band(row["std"], row["n"], ref["std"], ref["n"])
        row["within_noise"] = within_noise(*stats)
    return per_mode


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: per mode, held-out reward over seeds, difference to colocated, verdict."""
    seeds = ",".join(str(s) for s in result["seeds"])
    lines = [
        f"learning per execution mode, 2 processes, {result['steps_per_run']} steps per run, seeds {seeds}",
        f"held-out reward after training; {RULE}",
        f"{'mode':<16}{'n':>3}{'mean':>9}{'std':>9}{'gain':>10}{'diff':>10}{'band':>9}  {'verdict':<14}"
        f"{'max lag/bound':>13}",
    ]
    for mode, row in result["per_mode"].items():
        verdict = "within noise" if row["within_noise"] else "OUTSIDE noise"
        lag = f"{row['max_lag']}/{result['max_staleness']}"
        lines.append(
            f"{mode:<16}{row['n']:>3}{row['mean']:>9.4f}{row['std']:>9.5f}{row['mean_gain']:>+10.5f}"
            f"{row['diff_to_colocated']:>+10.5f}{row['noise_band']:>9.5f}  {verdict:<14}{lag:>13}"
        )
    bound_text = "holds" if result["staleness_within_bound"] else "VIOLATED"
    lines.append(f"  staleness bound (max lag <= execution.max_staleness) in every run: {bound_text}")
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    """Held-out reward after training per mode: each seed and their mean, against before."""
    ax = axes[0]
    modes = list(result["per_mode"])
    values = []
    for x, mode in enumerate(modes):
        row = result["per_mode"][mode]
        after = row["heldout_reward_after"]
        values += after
        ax.bar(x, row["mean"], 0.6, color="C0", alpha=0.35, label="mean over seeds" if x == 0 else None)
        spread = [0.3 * (i / (len(after) - 1) - 0.5) for i in range(len(after))] if len(after) > 1 else [0.0]
        label = "one seed" if x == 0 else None
        ax.scatter([x + o for o in spread], after, color="C0", zorder=3, label=label)
    before = statistics.fmean(float(r["heldout_reward_before"]) for r in result["runs"])
    ax.axhline(before, color="grey", linestyle="--", linewidth=1, label="before training")
    low, high = min([*values, before]), max([*values, before])
    margin = max(high - low, 1e-3) * 0.5
    ax.set_ylim(low - margin, high + margin)
    ax.set_xticks(range(len(modes)), modes)
    ax.set_ylabel("held-out reward after training")
    ax.set_title(f"{result['steps_per_run']} steps, 2 processes")
    ax.legend(fontsize=8)
