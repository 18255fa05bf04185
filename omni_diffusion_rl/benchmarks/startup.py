"""`odrl bench startup`: what a process of the training stack spends before and around its work, with
the garbage collector on during its imports and with it paused and then frozen (runtime/startup.py).

Two pairs, each run as fresh processes in interleaved rounds (each round starts with the other one):
- the imports alone (`omni_diffusion_rl.trainers.trainer` and what it pulls in: torch, accelerate,
  diffusers, transformers, peft);
- a whole 2-step run of the tiny built-in model as the README's commands run it in the tests
  (held-out evaluation before and after, a checkpoint, wandb offline): `odrl train` through
  `cli.main`, as the console script ran it before, and through `cli.entry`, as it runs now.
Per process: CPU seconds (user + system, with whatever it started and waited for) and wall seconds.
The paused/frozen against on ratio is paired by round and called faster or slower only when every
round agrees, else "within noise". Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import DEFAULT_CONFIG, compare_paired, machine_info, publish, spread

IMPORTS = "import omni_diffusion_rl.trainers.trainer"
FROZEN_IMPORTS = (
    "from omni_diffusion_rl.runtime.forking_launcher import PRELOAD\n"
    "from omni_diffusion_rl.runtime.startup import import_frozen\n"
    "import_frozen(PRELOAD)"
)
RUN_THROUGH_MAIN = "import sys\nfrom omni_diffusion_rl.cli import main\nsys.exit(main())"
RUN_STEPS = ["train.steps=2", "data.prompts_per_step=2", "data.group_size=4", "sampling.num_steps=4"]
RUN_STEPS += ["data.eval_samples=8", "sampling.eval_num_steps=4", "train.overwrite=true"]
RUN_STEPS += ["train.progress=false"]
PAIRS = ("imports", "2-step run")
VARIANTS = ("collector on", "paused and frozen")


def _command(pair: str, variant: str, config: str, run_dir: Path) -> list[str]:
    if pair == "imports":
        return [sys.executable, "-c", IMPORTS if variant == "collector on" else FROZEN_IMPORTS]
    entry = ["-c", RUN_THROUGH_MAIN] if variant == "collector on" else ["-m", "omni_diffusion_rl.cli"]
    return [sys.executable, *entry, "train", config, *RUN_STEPS, f"train.output_dir={run_dir}"]


def measure(command: list[str], env: dict[str, str]) -> dict[str, float]:
    """One process's CPU seconds (its own and its waited-for children's) and wall seconds; a
    RuntimeError with its output's tail when it fails."""
    began = time.perf_counter()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - began
        if proc.returncode:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"{' '.join(command[:4])} ... ended with {proc.returncode}:\n{tail}")
    return {"cpu_s": round(usage.ru_utime + usage.ru_stime, 3), "wall_s": round(wall, 3)}


def run_startup_bench(
    output: Path, config: str | None = DEFAULT_CONFIG, repeats: int = 5, pairs: tuple[str, ...] = PAIRS
) -> dict[str, Any]:
    """`repeats` interleaved rounds of each of `pairs`; the report (also written to `output`)."""
    unknown = sorted(set(pairs) - set(PAIRS))
    if unknown or not pairs:
        raise ValueError(f"pairs {list(pairs)}: choose among {', '.join(PAIRS)}")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    rounds: dict[str, dict[str, list[dict[str, float]]]] = {p: {v: [] for v in VARIANTS} for p in pairs}
    with tempfile.TemporaryDirectory(prefix="odrl-startup-") as scratch:
        for index in range(repeats):
            order = VARIANTS if index % 2 == 0 else tuple(reversed(VARIANTS))
            for pair in pairs:
                for variant in order:
                    command = _command(pair, variant, config or DEFAULT_CONFIG, Path(scratch) / "run")
                    rounds[pair][variant].append(measure(command, env))
    result: dict[str, Any] = {"pairs": {}, "repeats": repeats, "machine": machine_info()}
    for pair, by_variant in rounds.items():
        on, frozen = by_variant[VARIANTS[0]], by_variant[VARIANTS[1]]
        spreads = {
            v: {k: spread([r[k] for r in rs]) for k in ("cpu_s", "wall_s")} for v, rs in by_variant.items()
        }
        result["pairs"][pair] = {
            "each_round": by_variant,
            **spreads,
            "frozen_vs_on_cpu": compare_paired([r["cpu_s"] for r in frozen], [r["cpu_s"] for r in on]),
            "frozen_vs_on_wall": compare_paired([r["wall_s"] for r in frozen], [r["wall_s"] for r in on]),
        }
    publish(result, output, format_table(result), _draw, (8.0, 3.5))
    return result


def format_table(result: dict[str, Any]) -> str:
    lines = [
        "| what | collector on: CPU s | paused and frozen: CPU s | CPU ratio - 1 | wall ratio - 1 "
        "| verdict (CPU) |",
        "|---|---|---|---|---|---|",
    ]
    for pair, row in result["pairs"].items():
        on, frozen = row[VARIANTS[0]]["cpu_s"]["median"], row[VARIANTS[1]]["cpu_s"]["median"]
        cpu, wall = row["frozen_vs_on_cpu"], row["frozen_vs_on_wall"]
        ratios = f"{cpu['median']:+.1%} | {wall['median']:+.1%}"
        lines.append(f"| {pair} | {on:.2f} | {frozen:.2f} | {ratios} | {cpu['verdict']} |")
    lines.append(f"(medians over {result['repeats']} interleaved rounds; ratios paired by round)")
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    ax = axes[0]
    pairs = list(result["pairs"])
    width = 0.38
    for offset, variant in enumerate(VARIANTS):
        values = [result["pairs"][p][variant]["cpu_s"]["median"] for p in pairs]
        ax.bar([i + offset * width for i in range(len(pairs))], values, width, label=variant)
    ax.set_xticks([i + width / 2 for i in range(len(pairs))], pairs)
    ax.set_ylabel("CPU seconds per process (median)")
    ax.set_title("start-up: garbage collector on vs paused and frozen")
    ax.legend()
