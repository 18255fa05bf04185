"""`odrl bench sharding`: what FSDP2 sharding costs in time, 2 processes, sharded against unsharded.

The same colocated run of the tiny model (recipes/configs/tiny_t2av_nft.yaml, a few steps, nothing
but the loop) with train.sharding=none and =fsdp, in interleaved rounds (each round starts with the
other one). Per round: steady seconds per trained prompt (the loop after its first step) and the
median generation and training seconds per step; the sharded/unsharded ratio is paired by round and
called faster or slower only when every round agrees, else "within noise". On CPU the gloo
all-gathers of every block, in every forward and backward, are the whole cost: sharding buys memory
per process, not speed. Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .common import (
    DEFAULT_CONFIG,
    QUIET,
    compare_paired,
    launch_training,
    machine_info,
    median,
    publish,
    spread,
    steady_s_per_prompt,
)

LAYOUTS = {"unsharded": "train.sharding=none", "sharded": "train.sharding=fsdp"}


def _phases(run: Path) -> dict[str, float]:
    """Median generation and training seconds per step, the first step left out (warm-up)."""
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "time/train_s" in r][1:]
    return {
        "rollout_s": median([r["time/rollout_s"] for r in steps]),
        "train_s": median([r["time/train_s"] for r in steps]),
    }


def run_sharding_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    steps: int = 6,
    repeats: int = 3,
) -> dict[str, Any]:
    """`repeats` interleaved rounds of both layouts; the report (also written to `output`)."""
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    for round_index in range(repeats):
        order = list(LAYOUTS) if round_index % 2 == 0 else list(reversed(LAYOUTS))
        for name in order:
            folder = output.parent / "sharding_runs" / f"{name}_{round_index}"
            args = [*(overrides or []), *QUIET, LAYOUTS[name], f"train.steps={steps}"]
            summary = launch_training(config, [*args, f"train.output_dir={folder}"])
            runs[name].append({"s_per_prompt": steady_s_per_prompt(summary), **_phases(folder)})
    figures = {
        name: {key: spread([r[key] for r in rounds]) for key in ("s_per_prompt", "rollout_s", "train_s")}
        for name, rounds in runs.items()
    }
    paired = {
        key: compare_paired([r[key] for r in runs["sharded"]], [r[key] for r in runs["unsharded"]])
        for key in ("s_per_prompt", "rollout_s", "train_s")
    }
    result = {
        "machine": machine_info(),
        "processes": 2,
        "steps": steps,
        "rounds": runs,
        "figures": figures,
        "sharded_vs_unsharded": paired,
    }
    publish(result, output, _table(figures, paired), _draw, (7.0, 3.5))
    return result


def _table(figures: dict[str, Any], paired: dict[str, Any]) -> str:
    rows = ["| 2 processes | s per trained prompt | generation s/step | training s/step |"]
    rows.append("| --- | --- | --- | --- |")
    for name, f in figures.items():
        cells = [f"{f[k]['median']:.4f} [{f[k]['min']:.4f}-{f[k]['max']:.4f}]" for k in f]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    cells = [f"{p['median']:+.1%} [{p['min']:+.1%}, {p['max']:+.1%}] {p['verdict']}" for p in paired.values()]
    rows.append("| sharded / unsharded - 1 | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    ax = axes[0]
    names = list(result["figures"])
    keys = ("rollout_s", "train_s")
    for i, key in enumerate(keys):
        values = [result["figures"][n][key]["median"] for n in names]
        ax.bar([j + 0.4 * i for j in range(len(names))], values, width=0.4, label=key)
    ax.set_xticks([j + 0.2 for j in range(len(names))], names)
    ax.set_ylabel("seconds per step (median)")
    ax.legend()
