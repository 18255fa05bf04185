"""Benchmark: execution modes on this machine with 2 processes, against the simulator's prediction.

For each generation setting (by default 10 sampling steps, and 40 with the same 6 trained timesteps
per sample, so that generation grows 4x and training does not), every mode (auto, colocated 2+0,
separate 1+1, hybrid 1+1 with lending) trains the same number of steps, so the same number of
prompts, under `accelerate launch`; the modes take turns, `repeats` rounds, and the median is
reported. The unit costs auto measures inside the two running processes during its warm-up give
the simulator's prediction for every mode, reported next to each real run with the error. Real
seconds per trained prompt are steady-state: the training loop after its first step (start-up,
auto's warm-up, the async buffer's first fill and saving excluded; the warm-up and the whole-loop
figure are reported too). Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..execution.planner.simulate import MODES
from .common import DEFAULT_CONFIG, QUIET, launch_training, median, publish, steady_s_per_prompt

RUN_MODES = ("auto", "colocated", "separate", "hybrid")
SETTINGS = {
    "short": ["sampling.num_steps=10", "algorithm.timestep_fraction=0.6"],
    "long": ["sampling.num_steps=40", "algorithm.timestep_fraction=0.15"],
}


def run_modes_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    steps: int = 8,
    settings: dict[str, list[str]] | None = None,
    repeats: int = 2,
) -> dict[str, Any]:
    """Every mode `repeats` times per setting (default: short and long); real against predicted."""
    overrides = list(overrides or [])
    settings = settings or SETTINGS
    rows: dict[str, Any] = {}
    port = 29600
    for setting, setting_overrides in settings.items():
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in RUN_MODES}
        for round_index in range(repeats):
            for mode in RUN_MODES:
                port += 1
                run_dir = output.parent / f"modes_{setting}_{mode}_{round_index}"
                args = [*overrides, *setting_overrides, *QUIET, f"train.steps={steps}"]
                args += [f"train.output_dir={run_dir}", f"execution.mode={mode}"]
                runs[mode].append(launch_training(config, args, port))
        real = {m: median([steady_s_per_prompt(r) for r in runs[m]]) for m in RUN_MODES}
        whole = {m: median([r["seconds_per_trained_prompt"] for r in runs[m]]) for m in RUN_MODES}
        autos = [r["auto"] for r in runs["auto"]]
        predicted = {m: round(median([a["predicted_s_per_prompt"][m] for a in autos]), 4) for m in MODES}
        fixed = {m: real[m] for m in MODES}
        best = min(fixed, key=fixed.get)
        rows[setting] = {
            "overrides": setting_overrides,
            "real_s_per_prompt": {m: round(v, 4) for m, v in real.items()},
            "real_s_per_prompt_each_round": {m: [steady_s_per_prompt(r) for r in runs[m]] for m in RUN_MODES},
            "whole_loop_s_per_prompt": {m: round(v, 4) for m, v in whole.items()},
            "predicted_s_per_prompt": predicted,
            "prediction_error": {m: round(predicted[m] / real[m] - 1, 4) for m in MODES},
            "fastest_fixed_mode": best,
            "auto_picked": [a["picked"] for a in autos],
            "auto_vs_best": round(real["auto"] / fixed[best] - 1, 4),
            "auto_warmup_s": [a["warmup_s"] for a in autos],
            "hybrid_vs_separate": round(real["hybrid"] / real["separate"] - 1, 4),
            "hybrid_lends": [r["execution"]["hybrid"]["lends"] for r in runs["hybrid"]],
            "idle_fraction": {m: runs[m][0]["execution"]["idle_fraction"] for m in ("separate", "hybrid")},
            "measured_costs": autos[0]["measured_costs"],
        }
    result = {"processes": 2, "steps_per_run": steps, "rounds": repeats, "settings": rows}
    publish(result, output, format_table(result), _draw, (4.5 * len(rows), 3.2), panels=len(rows))
    return result


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: per setting and mode, real and predicted seconds per prompt."""
    lines = [
        f"execution modes, 2 processes, {result['steps_per_run']} steps per run, median of "
        f"{result['rounds']} rounds (steady seconds per trained prompt; whole loop incl. the first step)",
        f"{'setting':<9}{'mode':<11}{'real':>8}{'predicted':>11}{'error':>8}{'whole':>8}",
    ]
    for setting, row in result["settings"].items():
        for mode in RUN_MODES:
            real = row["real_s_per_prompt"][mode]
            pred = row["predicted_s_per_prompt"].get(mode)
            err = row["prediction_error"].get(mode)
            pred_text = f"{pred:>11.3f}" if pred is not None else f"{'-':>11}"
            err_text = f"{err:>+8.0%}" if err is not None else f"{'-':>8}"
            whole = row["whole_loop_s_per_prompt"][mode]
            lines.append(f"{setting:<9}{mode:<11}{real:>8.3f}{pred_text}{err_text}{whole:>8.3f}")
        warmup = "/".join(f"{w:.1f}" for w in row["auto_warmup_s"])
        lines.append(
            f"  fastest fixed: {row['fastest_fixed_mode']}; auto picked {'/'.join(row['auto_picked'])} "
            f"({row['auto_vs_best']:+.1%} vs fastest, warm-up {warmup} s); "
            f"hybrid vs separate {row['hybrid_vs_separate']:+.1%} (lends {row['hybrid_lends']})"
        )
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    """Real against predicted seconds per prompt, one panel per setting."""
    for ax, (setting, row) in zip(axes, result["settings"].items(), strict=True):
        xs = range(len(RUN_MODES))
        ax.bar([x - 0.2 for x in xs], [row["real_s_per_prompt"][m] for m in RUN_MODES], 0.4, label="real")
        predicted = [row["predicted_s_per_prompt"].get(m, 0.0) for m in RUN_MODES]
        ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="predicted")
        ax.set_xticks(list(xs), RUN_MODES)
        ax.set_title(setting)
        ax.set_ylabel("seconds per trained prompt")
    axes[0].legend()
