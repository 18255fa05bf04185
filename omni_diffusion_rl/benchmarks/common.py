"""What the benchmarks share: the machine they ran on, 2-process training runs started from the
installed package (no recipes folder needed), medians, and publishing a report with its plot."""

from __future__ import annotations

import json
import os
import platform
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..runtime.launch import launcher_command
from ..runtime.subprocesses import run_process_tree
from ..runtime.threads import thread_share

# The training config of the 2-process benchmarks, relative to the working folder (as `odrl bench`'s
# --config default): the benchmarks run from a checkout of the repository.
DEFAULT_CONFIG = "recipes/configs/tiny_t2av_nft.yaml"
# Overrides that keep a benchmark's training run to the loop being timed.
QUIET = ["train.eval_at_start_and_end=false", "train.preview_every=0", "train.checkpoint_every=0"]
QUIET += ["train.progress=false", "tracking.wandb=false", "train.overwrite=true"]  # bench-owned folders
LAUNCH_TIMEOUT_S = 3600


def machine_info() -> dict[str, Any]:
    """What the timings depend on."""
    import torch  # here: the launching benchmarks do not need it in their own process

    return {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
        "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def launch_command(config: str | None, overrides: list[str], port: int = 0) -> list[str]:
    """The launcher of 2 processes on this machine, each running `odrl train` as a module of the
    installed package (`python -m omni_diffusion_rl.cli train ...`). `cmd_train` arms the lifeline
    first thing, so the training processes die with the launcher."""
    return launcher_command(2, ["train", *([config] if config else []), *overrides], port)


def launch_training(config: str | None, overrides: list[str], port: int | None = None) -> dict[str, Any]:
    """One 2-process training run (on CPU unless ACCELERATE_USE_CPU says otherwise); its JSON summary.
    The processes meet on `port`, by default one the launcher binds itself (two benchmarks at once
    never meet, where fixed ports always did).

    The launcher runs through `run_process_tree`: it dies with this process, and whatever it leaves
    behind is killed when it ends or times out."""
    env = {**os.environ, "ACCELERATE_USE_CPU": os.environ.get("ACCELERATE_USE_CPU", "true")}
    env.setdefault("OMP_NUM_THREADS", str(thread_share(2)))
    command = launch_command(config, overrides, port or 0)
    done = run_process_tree(command, timeout_s=LAUNCH_TIMEOUT_S, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"benchmark run failed ({' '.join(overrides[-3:])}):\n{done.stderr[-3000:]}")
    return json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])


def steady_s_per_prompt(summary: dict[str, Any]) -> float:
    """Steady seconds per trained prompt (the whole loop's when the run had a single step)."""
    return float(summary.get("steady_seconds_per_trained_prompt", summary["seconds_per_trained_prompt"]))


def median(values: list[float]) -> float:
    """The median, as a float."""
    return float(statistics.median(values))


def spread(values: list[float]) -> dict[str, float]:
    """Median, min, max and the range relative to the median, of one figure over rounds."""
    mid = median(values)
    return {
        "median": round(mid, 4),
        "min": round(min(values), 4),
        "max": round(max(values), 4),
        "relative_range": round((max(values) - min(values)) / mid, 4) if mid else float("nan"),
    }


def compare_paired(
    a: list[float], b: list[float], at_most: float | None = None, two_sided: bool = False
) -> dict[str, Any]:
    """a against b, paired by round (the rounds interleave the runs, so a pair saw the same state
    of the machine): r_i = a_i / b_i - 1. Without `at_most`: "faster" or "slower" when every round
    agrees on the sign, else "within noise". With `at_most` (a claim "a is at most that fraction
    slower than b"; `two_sided`: "a is within that fraction of b either way", as a prediction):
    "met" when every round is within it, "missed" when none is, else "within noise"."""
    ratios = [x / y - 1 for x, y in zip(a, b, strict=True)]
    low, high = min(ratios), max(ratios)
    if at_most is None:
        verdict = "faster" if high < 0 else "slower" if low > 0 else "within noise"
    else:
        gaps = [abs(r) for r in ratios] if two_sided else ratios
        verdict = "met" if max(gaps) <= at_most else "missed" if min(gaps) > at_most else "within noise"
    out: dict[str, Any] = {
        "median": round(median(ratios), 4),
        "min": round(low, 4),
        "max": round(high, 4),
        "each_round": [round(r, 4) for r in ratios],
        "verdict": verdict,
    }
    if at_most is not None:
        out["at_most"] = at_most
        if two_sided:
            out["two_sided"] = True
    return out


def publish(
    result: dict[str, Any],
    output: Path,
    table: str,
    draw: Callable[[list[Any], dict[str, Any]], None],
    size: tuple[float, float],
    panels: int = 1,
) -> None:
    """Print the table, write the JSON to `output` and the plot next to it (.png): `draw(axes,
    result)` fills a row of `panels` matplotlib axes in a figure of `size` inches."""
    print(table)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, panels, figsize=size, squeeze=False)
    draw(list(axes[0]), result)
    fig.tight_layout()
    fig.savefig(output.with_suffix(".png"), dpi=100)
    plt.close(fig)
    print(f"wrote {output} and {output.with_suffix('.png')}")
