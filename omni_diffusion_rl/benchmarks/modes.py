"""Benchmark: execution modes on this machine with 2 processes, against the simulator's prediction.

For each generation setting (by default 10 sampling steps, and 40 with the same 6 trained timesteps
per sample, so that generation grows 4x and training does not), every mode (auto, colocated 2+0,
separate 1+1, hybrid 1+1 with lending) trains the same number of steps, so the same number of
prompts, under `accelerate launch`. The modes take turns, `repeats` rounds, each round starting with
the next mode (so no mode always runs first or last); every figure is reported as the median over
rounds with its min and max. Comparisons are paired by round (a round's runs saw the same state of
this noisy machine) and stated as a verdict: faster / slower, or met / missed for a target, only
when every round agrees, otherwise "within noise" (common.compare_paired). The unit costs auto
measures inside the two running processes during its warm-up give the simulator's prediction for
every mode, reported next to each real run with the error. Real seconds per trained prompt are
steady-state: the training loop after its first step (start-up, auto's warm-up, the async buffer's
first fill and saving excluded; the warm-up and the whole-loop figure are reported too). Prints a
table, writes JSON and a bar chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..execution.planner.simulate import MODES
from .common import (
    DEFAULT_CONFIG,
    QUIET,
    compare_paired,
    launch_training,
    median,
    publish,
    spread,
    steady_s_per_prompt,
)

RUN_MODES = ("auto", "colocated", "separate", "hybrid")
SETTINGS = {
    "short": ["sampling.num_steps=10", "algorithm.timestep_fraction=0.6"],
    "long": ["sampling.num_steps=40", "algorithm.timestep_fraction=0.15"],
}
ANSWER_SETTINGS = {  # the autoregressive path (GSPO): the seed's natural vs forced-long answers
    "natural": ["algorithm.min_new_tokens=0"],
    "forced": ["algorithm.max_new_tokens=48", "algorithm.min_new_tokens=48"],
}
AUTO_TARGET = 0.05  # auto should be at most 5% slower than the fastest fixed mode
PREDICTION_TARGET = 0.15  # predictions within 15% of the real steady seconds


def round_order(round_index: int) -> list[str]:
    """The modes of one round, starting with a different one each round."""
    k = round_index % len(RUN_MODES)
    return [*RUN_MODES[k:], *RUN_MODES[:k]]


def run_modes_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    steps: int = 8,
    settings: dict[str, list[str]] | None = None,
    repeats: int = 4,
) -> dict[str, Any]:
    """Every mode `repeats` times per setting (default: short and long sampling, or for an answering
    policy natural and forced-long answers); real against predicted."""
    overrides = list(overrides or [])
    settings = settings or (ANSWER_SETTINGS if _answers(config, overrides) else SETTINGS)
    rows: dict[str, Any] = {}
    for setting, setting_overrides in settings.items():
        runs: dict[str, list[dict[str, Any]]] = {m: [] for m in RUN_MODES}
        for round_index in range(repeats):
            for mode in round_order(round_index):
                run_dir = output.parent / f"modes_{setting}_{mode}_{round_index}"
                args = [*overrides, *setting_overrides, *QUIET, f"train.steps={steps}"]
                args += [f"train.output_dir={run_dir}", f"execution.mode={mode}", "train.overwrite=true"]
                runs[mode].append(launch_training(config, args))
        rows[setting] = _setting_row(setting_overrides, runs)
    result = {"processes": 2, "steps_per_run": steps, "rounds": repeats, "settings": rows}
    publish(result, output, format_table(result), _draw, (4.5 * len(rows), 3.2), panels=len(rows))
    return result


def _answers(config: str | None, overrides: list[str]) -> bool:
    """Whether the config trains an answering policy (its length unit is the answer token)."""
    from ..config import load_config

    return load_config(config, overrides).model.family == "tiny_omni"


def _setting_row(setting_overrides: list[str], runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """One setting's figures (median, min, max over rounds), predictions and paired comparisons."""
    real = {m: [steady_s_per_prompt(r) for r in runs[m]] for m in RUN_MODES}
    whole = {m: [float(r["seconds_per_trained_prompt"]) for r in runs[m]] for m in RUN_MODES}
    autos = [r["auto"] for r in runs["auto"]]
    predicted = {m: round(median([a["predicted_s_per_prompt"][m] for a in autos]), 4) for m in MODES}
    medians = {m: median(real[m]) for m in RUN_MODES}
    best = min(MODES, key=lambda m: medians[m])
    picked_colocated = [i for i, a in enumerate(autos) if a["picked"] == "colocated"]
    return {
        "overrides": setting_overrides,
        "real_s_per_prompt": {m: spread(real[m]) for m in RUN_MODES},
        "real_s_per_prompt_each_round": {m: [round(v, 4) for v in real[m]] for m in RUN_MODES},
        "whole_loop_s_per_prompt": {m: spread(whole[m]) for m in RUN_MODES},
        "predicted_s_per_prompt": predicted,
        "prediction_error": {  # against each round's real figure: the error's own spread
            m: compare_paired(
                [predicted[m]] * len(real[m]), real[m], at_most=PREDICTION_TARGET, two_sided=True
            )
            for m in MODES
        },
        "fastest_fixed_mode": best,
        "auto_picked": [a["picked"] for a in autos],
        "auto_vs_fastest": compare_paired(real["auto"], real[best], at_most=AUTO_TARGET),
        # the same mode run by auto (its pick) and directly: what auto itself costs while running
        "auto_running_colocated_vs_colocated": compare_paired(
            [real["auto"][i] for i in picked_colocated], [real["colocated"][i] for i in picked_colocated]
        )
        if picked_colocated
        else None,
        "auto_warmup_s": [a["warmup_s"] for a in autos],
        "separate_vs_colocated": compare_paired(real["separate"], real["colocated"]),
        "hybrid_vs_separate": compare_paired(real["hybrid"], real["separate"]),
        "hybrid_vs_colocated": compare_paired(real["hybrid"], real["colocated"]),
        "hybrid_lends": [r["execution"]["hybrid"]["lends"] for r in runs["hybrid"]],
        "idle_fraction": {m: runs[m][0]["execution"]["idle_fraction"] for m in ("separate", "hybrid")},
        # each round's auto: the costs it measured and what the simulator predicted from them (a test
        # re-simulates these against the same round's real seconds: timings the simulator was not fitted to)
        "auto_each_round": [
            {"measured_costs": a["measured_costs"], "predicted_s_per_prompt": a["predicted_s_per_prompt"]}
            for a in autos
        ],
    }


def _range(figure: dict[str, float]) -> str:
    return f"{figure['median']:.3f} [{figure['min']:.3f}-{figure['max']:.3f}]"


def _verdict(c: dict[str, Any] | None) -> str:
    if c is None:
        return "-"
    return f"{c['median']:+.1%} [{c['min']:+.1%}, {c['max']:+.1%}] {c['verdict']}"


def format_table(result: dict[str, Any]) -> str:
    """Plain-text table: per setting and mode, real (median [min-max] over rounds) and predicted
    seconds per prompt, then the paired comparisons with their verdicts."""
    lines = [
        f"execution modes, 2 processes, {result['steps_per_run']} steps per run, {result['rounds']} "
        "interleaved rounds; steady seconds per trained prompt, median [min-max]; whole loop incl. the "
        "first step",
        f"{'setting':<9}{'mode':<11}{'real':>22}{'predicted':>11}{'error':>26}{'whole':>22}",
    ]
    for setting, row in result["settings"].items():
        for mode in RUN_MODES:
            pred = row["predicted_s_per_prompt"].get(mode)
            pred_text = f"{pred:>11.3f}" if pred is not None else f"{'-':>11}"
            err = row["prediction_error"].get(mode)
            err_text = f"{err['median']:+.0%} [{err['min']:+.0%}, {err['max']:+.0%}]" if err else "-"
            real, whole = row["real_s_per_prompt"][mode], row["whole_loop_s_per_prompt"][mode]
            lines.append(
                f"{setting:<9}{mode:<11}{_range(real):>22}{pred_text}{err_text:>26}{_range(whole):>22}"
            )
        warmup = "/".join(f"{w:.1f}" for w in row["auto_warmup_s"])
        lines += [
            f"  auto picked {'/'.join(row['auto_picked'])} (warm-up {warmup} s); vs the fastest fixed "
            f"mode ({row['fastest_fixed_mode']}, target <= {AUTO_TARGET:+.0%}): "
            f"{_verdict(row['auto_vs_fastest'])}",
            f"  auto running colocated vs colocated: {_verdict(row['auto_running_colocated_vs_colocated'])}",
            f"  separate vs colocated: {_verdict(row['separate_vs_colocated'])}; hybrid vs separate: "
            f"{_verdict(row['hybrid_vs_separate'])} (lends {row['hybrid_lends']}); hybrid vs colocated: "
            f"{_verdict(row['hybrid_vs_colocated'])}",
        ]
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    """Real against predicted seconds per prompt, one panel per setting."""
    for ax, (setting, row) in zip(axes, result["settings"].items(), strict=True):
        xs = range(len(RUN_MODES))
        real = [row["real_s_per_prompt"][m] for m in RUN_MODES]
        low = [r["median"] - r["min"] for r in real]
        high = [r["max"] - r["median"] for r in real]
        medians = [r["median"] for r in real]
        ax.bar([x - 0.2 for x in xs], medians, 0.4, yerr=[low, high], capsize=3, label="real (min-max)")
        predicted = [row["predicted_s_per_prompt"].get(m, 0.0) for m in RUN_MODES]
        ax.bar([x + 0.2 for x in xs], predicted, 0.4, label="predicted")
        ax.set_xticks(list(xs), RUN_MODES)
        ax.set_title(setting)
        ax.set_ylabel("seconds per trained prompt")
    axes[0].legend()
