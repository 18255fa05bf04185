"""`odrl bench memory --measure`: the measured side of `odrl bench memory`'s on-paper estimate.

Tiny random-init LTX-2 and MiniMax-H3 models (tiny_families.py, wider transformers so that FSDP2's
dim-0 padding is negligible) and the shipped tiny base (`model.pretrained=builtin`, the demo's
recipe) each train one step at 1, 2 and 4 processes, with and without train.sharding=fsdp. Every
process builds its Trainer as `odrl train` does (`Accelerator(cpu=True)`, then `Trainer(cfg,
accelerator)`), runs one step (so gradients and AdamW state exist) and measures, from the tensors'
own storage (sharding.local_bytes: a shard's local part, its padding included):

- base: the transformer's frozen weights (every parameter not named `lora_`);
- adapters: both LoRA adapters (`default`, trained, and `old`, the sampling copy);
- grads: the gradients of the trained parameters;
- optimizer: AdamW's state tensors (moments and step counts);
- other frozen: the parameters outside the transformer (VAEs, text encoders, vocoder), whole on
  every process;
- start-up RSS: the process's resident-set high-water mark (getrusage, imports included) once its
  Trainer is built, before any step: the host memory loading takes (a sharded LTX-2 or H3 reads
  only its own part of the transformer's weights, models/shard_loading.py);
- peak RSS: the same high-water mark after the step.

A row's figure is the largest over its processes. The processes are started by torch's own launcher
(`python -m torch.distributed.run`, the elastic agent `accelerate launch` runs too), not by
`accelerate launch`: an accelerate config file on the machine (an FSDP one sets ACCELERATE_USE_FSDP,
which turns sharding on) cannot then change what a row measures, and ACCELERATE_USE_FSDP is taken out
of the launched environment for the same reason.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.launch import free_port
from ..runtime.subprocesses import run_process_tree
from .common import DEFAULT_CONFIG, QUIET, machine_info, publish

FAMILIES = ("tiny_av", "ltx2", "minimax_h3")
PROCESSES = (1, 2, 4)
WIDTHS = {"ltx2": 128, "minimax_h3": 128}
"""The transformer widths of the tiny LTX-2 and H3 (the tests' are 16 and 32)."""
LAUNCH_TIMEOUT_S = 240.0
SCALING_TOLERANCE = 0.10
"""Sharded, the base per process must be within 10% of 1/N of the 1-process figure."""
MIB = float(1 << 20)
WORKER_MODULE = "omni_diffusion_rl.benchmarks.memory_measured"  # this module, also when run as __main__
FIGURES = ("base", "adapters", "grads", "optimizer", "other_frozen", "startup_rss", "peak_rss")
# Small steps: the memory held does not depend on how long the step samples.
STEP = ["sampling.num_steps=2", "data.prompts_per_step=4", "data.group_size=2", "train.steps=1"]


@dataclass(frozen=True)
class Case:
    """One measured launch: a family's run at `processes` processes, sharded or not."""

    family: str
    processes: int
    sharding: str  # "none" or "fsdp"

    @property
    def name(self) -> str:
        return f"{self.family}_{self.processes}_{self.sharding}"


def measured_cases(families: Sequence[str], processes: Sequence[int]) -> list[Case]:
    """Every family at every process count, unsharded and sharded (one process only once: it
    keeps whole weights either way)."""
    cases = []
    for family in families:
        for n in sorted(set(processes)):
            cases += [Case(family, n, sharding) for sharding in (("none",) if n == 1 else ("none", "fsdp"))]
    return cases


# ---------------------------------------------------------------- the worker (one process of a launch)
def run_worker(config: str | None, overrides: list[str], out: Path) -> None:
    """Build the Trainer as `odrl train` does, train one step, write this rank's figures to `out`."""
    from ..runtime.lifeline import exit_with_parent

    exit_with_parent()  # a killed launcher takes this process down
    from accelerate import Accelerator

    from ..config import load_config
    from ..trainers.trainer import Trainer

    cfg = load_config(config, overrides)
    Path(cfg.train.output_dir).mkdir(parents=True, exist_ok=True)
    accelerator = Accelerator(cpu=True)
    trainer = Trainer(cfg, accelerator)
    startup_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    try:
        trainer.source.start()
        trainer.train_step()
        trainer.source.finish()
        figures = held_bytes(trainer, startup_rss)
    finally:
        trainer.close_scorers()
    record = {"rank": trainer.rank, "pid": os.getpid(), "sharded": trainer.sharded, **figures}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{trainer.rank}.json").write_text(json.dumps(record), encoding="utf-8")
    accelerator.wait_for_everyone()
    accelerator.end_training()  # the process group closed by every process, not left to exit


def held_bytes(trainer: Any, startup_rss: int) -> dict[str, int]:
    """Bytes this process stores for each of FIGURES (peak RSS: the high-water mark so far)."""
    import torch

    from ..runtime.sharding import local_bytes

    named = list(trainer.transformer.named_parameters())
    states = trainer.optimizer.state.values()
    return {
        "base": local_bytes([p for name, p in named if "lora_" not in name]),
        "adapters": local_bytes([p for name, p in named if "lora_" in name]),
        "grads": local_bytes([p.grad for p in trainer.params if p.grad is not None]),
        "optimizer": local_bytes([t for s in states for t in s.values() if isinstance(t, torch.Tensor)]),
        "other_frozen": local_bytes(frozen_outside_transformer(trainer.policy)),
        "startup_rss": startup_rss,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
    }


def frozen_outside_transformer(policy: Any) -> list[Any]:
    """The parameters of the policy's modules other than its transformer: its own module attributes
    and those of a diffusers pipeline it holds (LTX-2's)."""
    from torch import nn

    modules: list[nn.Module] = []
    for value in vars(policy).values():
        if isinstance(value, nn.Module):
            modules.append(value)
        components = getattr(value, "components", None)
        if isinstance(components, dict):
            modules += [c for c in components.values() if isinstance(c, nn.Module)]
    inside = {id(p) for p in policy.transformer.parameters()}
    unique = {id(p): p for m in modules for p in m.parameters() if id(p) not in inside}
    return list(unique.values())


# ---------------------------------------------------------------- the runs
def family_run(
    family: str, folder: Path, tiny_config: str | Path, widths: dict[str, int] = WIDTHS
) -> tuple[str | None, list[str]]:
    """The config file and overrides that train `family` (its model saved under `folder`, its
    transformer `widths[family]` wide)."""
    from .tiny_families import H3_CLIP, LTX2_CLIP, save_tiny_h3, save_tiny_ltx2, write_av_level_plugin

    if family == "tiny_av":
        return str(Path(tiny_config).resolve()), ["model.pretrained=builtin", *QUIET, *STEP]
    savers = {"ltx2": (save_tiny_ltx2, LTX2_CLIP), "minimax_h3": (save_tiny_h3, H3_CLIP)}
    save, clip = savers[family]  # check_choice: one of them
    model = save(folder / "model", width=widths[family])
    plugin = write_av_level_plugin(folder)
    options = "{" + ", ".join(f"{k}: {v}" for k, v in clip.items()) + "}"
    overrides = [f"model.family={family}", f"model.pretrained={model}", f"model.options={options}"]
    overrides += ["model.lora_rank=4", "model.lora_alpha=8", "optim.lr=3e-4", "eval.metrics=[]"]
    overrides += [f"reward.plugins=[{plugin}]", "reward.weights={tiny_av_level: 1}", *QUIET, *STEP]
    return None, overrides


def check_choice(processes: Sequence[int], families: Sequence[str]) -> None:
    """A ValueError before anything runs when a family is not measured here or a count is below 1."""
    unknown = [f for f in families if f not in FAMILIES]
    if unknown or not families:
        raise ValueError(f"families {list(families)}: choose among {', '.join(FAMILIES)}")
    if not processes or min(processes) < 1:
        raise ValueError(f"processes {list(processes)}: give process counts of at least 1")


def launch_command(case: Case, config: str | None, overrides: list[str], out: Path) -> list[str]:
    """torch's launcher starting `case.processes` workers of this module."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(case.processes)]
    command += ["--master_port", str(free_port()), "-m", WORKER_MODULE, "--worker", "--out", str(out)]
    command += ["--config", config] if config else []
    return [*command, *overrides]


def launch_env() -> dict[str, str]:
    """This environment for the workers: CPU (gloo), one thread each unless set, offline, and no
    accelerate FSDP variables (the case says whether to shard)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FSDP_") and k != "ACCELERATE_USE_FSDP"}
    env |= {
        "ACCELERATE_USE_CPU": "true",
        "HF_HUB_OFFLINE": "1",
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def measure_case(
    case: Case, config: str | None, overrides: list[str], folder: Path, timeout_s: float
) -> dict[str, Any]:
    """One launch of `case`; its row: the largest figure over its processes, and each process's."""
    out = folder / case.name
    extra = [f"train.sharding={case.sharding}", f"train.output_dir={out / 'run'}"]
    command = launch_command(case, config, [*overrides, *extra], out / "ranks")
    started = time.perf_counter()
    try:
        done = run_process_tree(command, timeout_s, env=launch_env())
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"memory measurement {case.name} ran past {timeout_s:g} s and was stopped") from e
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement {case.name} failed:\n{done.stderr[-4000:]}")
    ranks = [json.loads((out / "ranks" / f"rank{r}.json").read_text()) for r in range(case.processes)]
    sharded = case.sharding == "fsdp" and case.processes > 1
    if any(r["sharded"] != sharded for r in ranks):
        raise RuntimeError(f"memory measurement {case.name}: the run's sharding is not the one asked for")
    row: dict[str, Any] = {"family": case.family, "processes": case.processes, "sharding": case.sharding}
    row |= {f"{k}_bytes": max(r[k] for r in ranks) for k in FIGURES}
    row["seconds"] = round(time.perf_counter() - started, 1)
    row |= {"pids": [r["pid"] for r in ranks], "ranks": ranks}
    return row


def add_base_fractions(rows: list[dict[str, Any]]) -> None:
    """Each row's base bytes over its family's 1-process figure (None without a 1-process row)."""
    single = {r["family"]: r["base_bytes"] for r in rows if r["processes"] == 1}
    for row in rows:
        whole = single.get(row["family"])
        row["base_fraction"] = round(row["base_bytes"] / whole, 4) if whole else None


def scaling_verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per family and sharded process count: the base fraction against 1/N, within SCALING_TOLERANCE?"""
    verdicts: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["sharding"] != "fsdp" or row["base_fraction"] is None:
            continue
        ideal = 1.0 / row["processes"]
        relative = row["base_fraction"] / ideal - 1.0
        verdicts.setdefault(row["family"], {})[str(row["processes"])] = {
            "base_fraction": row["base_fraction"],
            "ideal": ideal,
            "relative_error": round(relative, 4),
            "within_tolerance": abs(relative) <= SCALING_TOLERANCE,
        }
    return verdicts


def format_table(rows: list[dict[str, Any]]) -> str:
    """The markdown table of the rows (MiB per process)."""
    head = ["family", "processes", "sharding", "base MiB/process", "base / 1-process", "adapters MiB"]
    head += ["grads MiB", "optimizer MiB", "other frozen MiB", "start-up RSS MiB", "peak RSS MiB"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in rows:
        fraction = "" if r["base_fraction"] is None else f"{r['base_fraction']:.3f}"
        cells = [r["family"], str(r["processes"]), r["sharding"], f"{r['base_bytes'] / MIB:.3f}", fraction]
        cells += [f"{r[f'{k}_bytes'] / MIB:.3f}" for k in FIGURES[1:-2]]
        cells += [f"{r['startup_rss_bytes'] / MIB:.0f}", f"{r['peak_rss_bytes'] / MIB:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _series(rows: list[dict[str, Any]], family: str, sharding: str) -> list[dict[str, Any]]:
    """A family's rows with that sharding, its 1-process row first."""
    return [r for r in rows if r["family"] == family and (r["sharding"] == sharding or r["processes"] == 1)]


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    """Left: the frozen base per process over the 1-process figure, against 1/N. Right: every
    measured tensor per process (base, adapters, gradients, AdamW, other frozen), in MiB."""
    rows = result["rows"]
    counts = sorted({r["processes"] for r in rows})
    tensors = [f"{k}_bytes" for k in FIGURES[:-1]]
    for family, marker in zip(dict.fromkeys(r["family"] for r in rows), "osd^v", strict=False):
        for sharding, style in (("none", "--"), ("fsdp", "-")):
            series = _series(rows, family, sharding)
            x = [r["processes"] for r in series]
            label = f"{family} {sharding}"
            axes[0].plot(x, [r["base_fraction"] for r in series], style, marker=marker, label=label)
            axes[1].plot(
                x, [sum(r[k] for k in tensors) / MIB for r in series], style, marker=marker, label=label
            )
    axes[0].plot(counts, [1 / n for n in counts], "k:", linewidth=3, label="1/N")
    axes[0].set(xlabel="processes", ylabel="frozen base per process / 1 process", xticks=counts)
    axes[1].set(xlabel="processes", ylabel="tensors held per process (MiB)", xticks=counts)
    axes[0].legend(fontsize=7)


def run_memory_measurement(
    output: Path,
    processes: Sequence[int] = PROCESSES,
    families: Sequence[str] = FAMILIES,
    *,
    tiny_config: str | Path = DEFAULT_CONFIG,
    timeout_s: float = LAUNCH_TIMEOUT_S,
    width: int | None = None,
) -> list[dict[str, Any]]:
    """Measure every case (measured_cases), print the table and write the JSON to `output` (and a
    plot next to it); the rows. `tiny_config`: the tiny built-in model's recipe (the demo's);
    `timeout_s`: the most one launch may take (then it is stopped, with all its processes); `width`:
    the LTX-2 and H3 transformers' width (default WIDTHS; wider shows the weights' host memory)."""
    check_choice(processes, families)
    widths = WIDTHS if width is None else dict.fromkeys(WIDTHS, width)
    started = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="odrl-memory-") as tmp:
        for family in dict.fromkeys(families):
            folder = Path(tmp) / family
            config, overrides = family_run(family, folder, tiny_config, widths)
            for case in measured_cases([family], processes):
                rows.append(measure_case(case, config, overrides, folder, timeout_s))
    add_base_fractions(rows)
    result = {
        "rows": rows,
        "memory_scales": scaling_verdicts(rows),
        "tolerance": SCALING_TOLERANCE,
        "widths": widths,
        "seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(),
    }
    publish(result, output, format_table(rows), _draw, (11.0, 4.0), panels=2)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help="one process of a launch (internal)")
    parser.add_argument("--out", type=Path, help="--worker: the folder for this rank's JSON")
    parser.add_argument("--config", help="--worker: the config file")
    parser.add_argument("--output", type=Path, default=Path("runs/bench/memory_measured.json"))
    parser.add_argument("--processes", type=int, nargs="+", default=list(PROCESSES))
    parser.add_argument("--families", nargs="+", default=list(FAMILIES))
    parser.add_argument("--width", type=int, help="the LTX-2 and H3 transformers' width (default: WIDTHS)")
    args, overrides = parser.parse_known_args(argv)
    if overrides and not args.worker:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    if args.worker:
        if __name__ == "__main__":  # a launched process (startup.py: its entry point only)
            from ..runtime.startup import TRAINING_STACK, import_frozen

            import_frozen(TRAINING_STACK)
        run_worker(args.config, overrides, args.out)
    else:
        run_memory_measurement(args.output, args.processes, args.families, width=args.width)
    return 0


if __name__ == "__main__":
    sys.exit(main())
