"""Benchmark: execution modes on this machine with 2 processes, against the simulator's prediction.

For a short and a long generation setting (sampling steps), colocated 2+0 and separate 1+1 each
train the same number of steps (so the same number of prompts) under `accelerate launch`; the
report gives the seconds per trained prompt of each real run next to what the simulator predicts
from unit costs measured here first (`execution/measure.py`), and the prediction error. Hybrid and
auto are predicted only until their runtime exists. Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from .config import load_config
from .execution.costs import Workload
from .execution.measure import costs_to_json, measure_costs
from .execution.simulate import MODES, simulate

RUN_MODES = ("colocated", "separate")
QUIET = ["train.eval_at_start_and_end=false", "train.preview_every=0", "train.checkpoint_every=0"]
QUIET += ["train.progress=false", "tracking.wandb=false"]


def _launch(config: str | None, overrides: list[str], port: int) -> dict[str, Any]:
    """One 2-process training run; its JSON summary."""
    script = Path(__file__).resolve().parent.parent / "recipes" / "train_nft.py"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(port), str(script), *([config] if config else []), *overrides]
    env = {**os.environ, "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU", "true")}
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 2) // 2)))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({' '.join(overrides[-3:])}):\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def _seconds_per_prompt(mode: str, summary: dict[str, Any], prompts: int) -> float:
    if mode == "separate":
        return float(summary["execution"]["seconds_per_trained_prompt"])
    return float(summary["seconds"]) / prompts


def run_modes_bench(
    output: Path,
    config: str | None = "recipes/configs/tiny_t2av_nft.yaml",
    overrides: list[str] | None = None,
    steps: int = 6,
    long_factor: int = 4,
) -> dict[str, Any]:
    overrides = list(overrides or [])
    cfg = load_config(config, overrides)
    short = cfg.sampling.num_steps
    lengths = {"short": short, "long": short * long_factor}
    threads = max(1, (os.cpu_count() or 2) // 2)
    costs = measure_costs(cfg, short, lengths["long"], threads=threads)
    work = Workload(
        replicas=2,
        prompts_per_step=cfg.data.prompts_per_step,
        group_size=cfg.data.group_size,
        rollout_replicas=1,
        sync_every=cfg.execution.sync_every,
        max_staleness=cfg.execution.max_staleness,
        on_stale=cfg.execution.on_stale,
        buffer_groups=cfg.execution.buffer_groups,
    )
    prompts = steps * cfg.data.prompts_per_step
    rows: dict[str, Any] = {}
    port = 29600
    for setting, length in lengths.items():
        predicted = {m: simulate(m, costs.with_length(length), work, steps).seconds_per_prompt for m in MODES}
        real = {}
        for mode in RUN_MODES:
            port += 1
            run_dir = output.parent / f"modes_{setting}_{mode}"
            args = [*overrides, *QUIET, f"train.steps={steps}", f"sampling.num_steps={length}"]
            args += [f"execution.mode={mode}", f"train.output_dir={run_dir}"]
            real[mode] = _seconds_per_prompt(mode, _launch(config, args, port), prompts)
        rows[setting] = {
            "sampling_steps": length,
            "real_s_per_prompt": {m: round(v, 4) for m, v in real.items()},
            "predicted_s_per_prompt": {m: round(v, 4) for m, v in predicted.items()},
            "prediction_error": {m: round(predicted[m] / real[m] - 1, 4) for m in real},
            "fastest_real": min(real, key=real.get),
            "auto_would_pick": min(predicted, key=predicted.get),
        }
    result = {
        "processes": 2,
        "steps_per_run": steps,
        "prompts_per_run": prompts,
        "measured_costs": costs_to_json(costs),
        "settings": rows,
    }
    print(format_table(result))
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    _plot(result, output.with_suffix(".png"))
    print(f"wrote {output} and {output.with_suffix('.png')}")
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        f"execution modes, 2 processes, {result['prompts_per_run']} trained prompts per run (s per prompt)",
        f"{'setting':<8}{'steps':>6}  {'mode':<10}{'real':>8}{'predicted':>11}{'error':>8}",
    ]
    for setting, row in result["settings"].items():
        for mode in MODES:
            real = row["real_s_per_prompt"].get(mode)
            pred = row["predicted_s_per_prompt"][mode]
            err = row["prediction_error"].get(mode)
            real_text = f"{real:>8.3f}" if real is not None else f"{'-':>8}"
            err_text = f"{err:>+8.0%}" if err is not None else f"{'-':>8}"
            lines.append(
                f"{setting:<8}{row['sampling_steps']:>6}  {mode:<10}{real_text}{pred:>11.3f}{err_text}"
            )
        lines.append(f"  fastest: {row['fastest_real']}; auto would pick: {row['auto_would_pick']}")
    return "\n".join(lines)


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = list(result["settings"])
    fig, axes = plt.subplots(1, len(settings), figsize=(4.5 * len(settings), 3.2), squeeze=False)
    for ax, setting in zip(axes[0], settings, strict=True):
        row = result["settings"][setting]
        xs = range(len(MODES))
        ax.bar([x - 0.2 for x in xs], [row["real_s_per_prompt"].get(m, 0) for m in MODES], 0.4, label="real")
        ax.bar(
            [x + 0.2 for x in xs], [row["predicted_s_per_prompt"][m] for m in MODES], 0.4, label="predicted"
        )
        ax.set_xticks(list(xs), MODES)
        ax.set_title(f"{setting} ({row['sampling_steps']} sampling steps)")
        ax.set_ylabel("seconds per trained prompt")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
