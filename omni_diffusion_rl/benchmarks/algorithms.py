"""Benchmark: a race of the algorithms on held-out quality per second and per sample.

Every contestant trains the tiny world from the same base for the same steps, one process each on
this machine, with the held-out evaluation every `eval_every` steps (`eval.every`) by the tiny
world's judge, which nothing trains on. Runs interleave: seed 0 of every contestant, then seed 1,
and so on, so that a change in the machine's load falls on all of them alike. With `jobs` > 1 that
many runs train at once, in the same order, each with an equal share of the cores as its thread
budget (on 2 cores the tiny world runs about as fast on 1 thread as on 2, so 2 jobs halve the race).
A contestant may be a variant of another, `nft@algorithm.adv_per_reward=true@optim.lr=3e-3`: its
config with those overrides, to measure one change at a time on the judge's curve.

For each contestant the report gives, over seeds (median and range): the training seconds and the
generated samples at the first evaluation that reached each accuracy threshold (0.5 and 0.9 by
default; "not reached" counts are stated), the final accuracy and the final health signs (flooded
frames, a recognisable shape, diversity). A difference is called "within the seed spread" when the
two contestants' ranges over seeds overlap. The headline is DiffusionNFT's median time to the
highest threshold against Flow-GRPO's. Accuracy is "all attributes right" (colour, shape, pitch
and timing) of each held-out sample. Prints a table, writes JSON and a plot of accuracy against
training seconds and against generated samples.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..runtime.subprocesses import kill_session, run_process_tree
from ..runtime.threads import thread_share
from .common import LAUNCH_TIMEOUT_S, machine_info, median, publish

ACCURACY = "eval/tiny_world_judge"
HEALTH = ("flooded", "recognisable_shape", "diversity", "background_noise", "shape_texture")
"""The judge's health signs and picture measures reported with each final accuracy."""
HEALTH_DIGITS = {"background_noise": 4, "shape_texture": 3}  # the measures are small: 0 is the world's
ATTRIBUTES = ("color", "shape", "pitch", "timing")
"""Each attribute's held-out accuracy, kept with the curves: which one lags (the shape, for NFT)."""
THRESHOLDS = (0.5, 0.9)
NFT_CONFIG = "recipes/configs/tiny_t2av_nft.yaml"
FLOW_GRPO_CONFIG = "recipes/configs/tiny_t2av_flow_grpo.yaml"
DISTILL_CONFIG = "recipes/configs/tiny_t2av_distill.yaml"
AWM_CONFIG = "recipes/configs/tiny_t2av_awm.yaml"


@dataclass(frozen=True)
class Contestant:
    """A training config and its overrides, as one contestant of the race."""

    config: str
    overrides: tuple[str, ...] = ()
    about: str = ""


CONTESTANTS = {
    "nft": Contestant(NFT_CONFIG, (), "DiffusionNFT, the demo's defaults"),
    "flow_grpo": Contestant(FLOW_GRPO_CONFIG, (), "Flow-GRPO, SDE rollouts, every step but the last"),
    "mixgrpo": Contestant(
        FLOW_GRPO_CONFIG,
        ("algorithm.sde_window_size=3", "algorithm.sde_window_every=20", "algorithm.timestep_fraction=1.0"),
        "Flow-GRPO with MixGRPO's window: the SDE and training on 3 steps that slide",
    ),
    "flow_grpo_fast": Contestant(
        FLOW_GRPO_CONFIG,
        (  # flow_grpo's fast configs: a window of 3 drawn in the first half, no KL, its normaliser
            "algorithm.sde_window_size=3",
            "algorithm.sde_window_range=5",
            "algorithm.sde_noise=0.8",
            "algorithm.clip_range=1e-5",
            "algorithm.kl_coef=0",
            "algorithm.timestep_fraction=1.0",
            "algorithm.per_group_std=false",
            "algorithm.drop_zero_advantage=true",
        ),
        "Flow-GRPO-Fast as flow_grpo's fast configs run it: the SDE on 3 steps drawn in the first half",
    ),
    "awm": Contestant(AWM_CONFIG, (), "AWM, the reference's GenEval values and NFT's learning rate"),
    "raft": Contestant(
        NFT_CONFIG,
        ("algorithm.name=raft", "optim.lr=3e-4"),  # at NFT's 2e-3 it wrecks the picture by step 60
        "RAFT: flow matching on each group's best, lr 3e-4",
    ),
    "distill": Contestant(
        DISTILL_CONFIG, (), "on-policy distillation from the shipped teacher, its recipe's adapter"
    ),
}


VARIANT_SEPARATOR = "@"


def contestant(name: str, shared: Sequence[str] = ()) -> Contestant:
    """A contestant by name: one of CONTESTANTS, or `base@section.key=value@...`, the base with
    those overrides, checked now (with the race's `shared` overrides first), before any run starts."""
    from ..config import load_config

    base_name, *changes = name.split(VARIANT_SEPARATOR)
    if base_name not in CONTESTANTS:
        raise ValueError(
            f"unknown contestant '{base_name}'; choose from {', '.join(CONTESTANTS)}, or a variant "
            f"such as nft{VARIANT_SEPARATOR}algorithm.adv_per_reward=true"
        )
    base = CONTESTANTS[base_name]
    if not changes and not shared:
        return base
    bad = [c for c in changes if "=" not in c or not c.split("=", 1)[0]]
    if bad:
        raise ValueError(f"contestant '{name}': {bad} must be section.key=value overrides")
    about = f"{base.about}, with {', '.join(changes)}" if changes else base.about
    variant = Contestant(base.config, (*base.overrides, *changes), about)
    try:
        load_config(variant.config, [*shared, *variant.overrides])
    except ValueError as e:
        raise ValueError(f"contestant '{name}': {e}") from e
    return variant


def run_name(name: str) -> str:
    """A contestant's name as a folder name."""
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", name)


def read_curve(run_dir: Path) -> list[dict[str, float]]:
    """A run's held-out evaluations in order: step, training seconds, generated samples, accuracy
    and the health signs."""
    curve = []
    for line in (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        if ACCURACY not in row:
            continue
        point = {
            "step": row["step"],
            "seconds": row.get("eval/train_seconds", 0.0),
            "samples": row.get("eval/generated_samples", 0.0),
            "accuracy": row[ACCURACY],
        }
        curve.append(point | {h: row.get(f"{ACCURACY}/{h}", float("nan")) for h in (*HEALTH, *ATTRIBUTES)})
    return curve


def first_reach(curve: list[dict[str, float]], threshold: float) -> dict[str, float] | None:
    """The first evaluation whose accuracy is at least `threshold` (None: never)."""
    return next((point for point in curve if point["accuracy"] >= threshold), None)


def _range(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def _measured(points: list[dict[str, float]], key: str) -> dict[str, float] | None:
    """The range of `key` over the points that measured it (None when none did: an eval metric
    without that sign, or a report from before the sign existed)."""
    return _range([p[key] for p in points if math.isfinite(p.get(key, math.nan))])


def summarise(curves: list[list[dict[str, float]]], thresholds: Sequence[float]) -> dict[str, Any]:
    """One contestant over its seeds: time and samples to each threshold, final accuracy and health.
    `censored_seconds`: the median over every seed of its time to the threshold, or of its whole
    training time where it never got there (then a lower bound: `censored` is True)."""
    out: dict[str, Any] = {"seeds": len(curves)}
    for threshold in thresholds:
        firsts = [first_reach(c, threshold) for c in curves]
        reached = [p for p in firsts if p is not None]
        out[f"to_{threshold:g}"] = {
            "reached": len(reached),
            "seconds": _range([p["seconds"] for p in reached]),
            "samples": _range([p["samples"] for p in reached]),
            "steps": _range([p["step"] for p in reached]),
            "censored_seconds": median(
                [(p or c[-1])["seconds"] for p, c in zip(firsts, curves, strict=True)]
            ),
            "censored": len(reached) < len(curves),
        }
    finals = [c[-1] for c in curves]
    out["final_accuracy"] = _range([p["accuracy"] for p in finals])
    out["base_accuracy"] = _range([c[0]["accuracy"] for c in curves])
    out["final_health"] = {h: _measured(finals, h) for h in HEALTH}
    out["final_attributes"] = {a: _range([p.get(a, float("nan")) for p in finals]) for a in ATTRIBUTES}
    out["base_health"] = {h: _measured([c[0] for c in curves], h) for h in HEALTH}
    out["train_seconds"] = _range([p["seconds"] for p in finals])
    return out


def overlaps(a: dict[str, float] | None, b: dict[str, float] | None) -> bool | None:
    """Whether two ranges over seeds overlap (None when either is missing)."""
    if a is None or b is None:
        return None
    return a["min"] <= b["max"] and b["min"] <= a["max"]


def headline(per: dict[str, Any], threshold: float, reference: str = "nft", other: str = "flow_grpo") -> dict:
    """`other`'s median time to `threshold` over `reference`'s, each median over every seed with a
    seed that never got there counted at its whole training time: "exact" when both reached it on
    every seed, "at least" when only `other` missed on some (its median is then a lower bound),
    "at most" when only `reference` did, "unknown" when both did."""
    key = f"to_{threshold:g}"
    if reference not in per or other not in per:
        return {}
    ref, oth = per[reference][key], per[other][key]
    if ref["censored_seconds"] <= 0:
        return {"ratio": None, "kind": "unknown", "note": f"{reference} starts at or above {threshold:g}"}
    kind = {(False, False): "exact", (False, True): "at least", (True, False): "at most"}.get(
        (ref["censored"], oth["censored"]), "unknown"
    )
    ratio = None if kind == "unknown" else round(oth["censored_seconds"] / ref["censored_seconds"], 2)
    out: dict[str, Any] = {"ratio": ratio, "kind": kind}
    out["reached"] = {reference: ref["reached"], other: oth["reached"], "seeds": per[other]["seeds"]}
    if kind == "exact":
        lo = oth["seconds"]["min"] / ref["seconds"]["max"]
        hi = oth["seconds"]["max"] / ref["seconds"]["min"]
        out["range"] = [round(lo, 2), round(hi, 2)]
    return out


def run_algorithms_bench(
    output: Path,
    overrides: list[str] | None = None,
    contestants: Sequence[str] = tuple(CONTESTANTS),
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 240,
    eval_every: int = 20,
    thresholds: Sequence[float] = THRESHOLDS,
    jobs: int = 1,
) -> dict[str, Any]:
    """Train every contestant with every seed (interleaved, `jobs` at a time, each on its share of
    the cores), then summarise and compare."""
    twins = sorted(
        {run_name(c) for c in contestants if [run_name(o) for o in contestants].count(run_name(c)) > 1}
    )
    if twins:
        raise ValueError(f"contestants named twice (their runs would share a folder): {twins}")
    entrants = {name: contestant(name, list(overrides or [])) for name in contestants}
    if not seeds:
        raise ValueError("give at least one seed")
    if jobs < 1:
        raise ValueError(f"jobs must be at least 1, got {jobs}")
    threads = thread_budget(jobs)
    order = [(seed, name) for seed in seeds for name in contestants]

    procs: list[subprocess.Popen[str]] = []

    def train(seed: int, name: str) -> list[dict[str, float]]:
        run_dir = output.parent / f"algorithms_{run_name(name)}_seed{seed}"
        _train(entrants[name], run_dir, seed, steps, eval_every, list(overrides or []), threads, procs.append)
        curve = read_curve(run_dir)
        last = curve[-1]
        print(
            f"  {name} seed {seed}: accuracy {last['accuracy']:.3f} after {last['seconds']:.0f} s", flush=True
        )
        return curve

    if jobs == 1:  # in this thread: Ctrl-C stops the run in progress and the race
        done = [train(seed, name) for seed, name in order]
    else:
        done = _in_parallel(train, order, jobs, procs)
    curves: dict[str, list[list[dict[str, float]]]] = {c: [] for c in contestants}
    for (_, name), curve in zip(order, done, strict=True):
        curves[name].append(curve)
    result = race_result(curves, thresholds) | {
        "steps": steps,
        "eval_every": eval_every,
        "seeds": list(seeds),
        "jobs": jobs,
        "threads_per_run": threads,
    }
    publish(result, output, format_table(result), _draw, (11.0, 4.0), panels=2)
    return result


def race_result(
    curves: dict[str, list[list[dict[str, float]]]], thresholds: Sequence[float]
) -> dict[str, Any]:
    """The race's report from each contestant's curves (one per seed): summaries, the comparisons
    with nft and the headline (Flow-GRPO against DiffusionNFT) at each threshold."""
    per = {name: summarise(runs, thresholds) for name, runs in curves.items()}
    return {
        "machine": machine_info(),
        "thresholds": list(thresholds),
        "contestants": {name: contestant(name).about for name in curves},
        "per_contestant": per,
        "curves": curves,
        "within_seed_spread_of_nft": {f"{t:g}": _spreads(per, t) for t in thresholds},
        "headline": {f"{t:g}": headline(per, t) for t in thresholds},
    }


def _in_parallel(
    train: Callable[[int, str], list[dict[str, float]]],
    order: list[tuple[int, str]],
    jobs: int,
    procs: list[subprocess.Popen[str]],
) -> list[list[dict[str, float]]]:
    """Each (seed, name) of `order` trained `jobs` at a time; on a failure or Ctrl-C the queued runs
    are cancelled and the running ones killed (`procs`: every run's process, as it starts)."""
    pool = ThreadPoolExecutor(max_workers=jobs)
    try:
        futures = [pool.submit(train, seed, name) for seed, name in order]
        return [f.result() for f in futures]
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            kill_session(proc)
        raise
    finally:
        pool.shutdown(wait=True)


def thread_budget(jobs: int) -> int:
    """Threads for each of `jobs` concurrent runs: an equal share (at least 1) of the race's budget,
    OMP_NUM_THREADS when set, else the host's CPUs."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    if given and not (given.isdigit() and int(given) > 0):
        raise ValueError(f"OMP_NUM_THREADS={given!r} is not a positive whole number of threads")
    return thread_share(jobs, int(given) if given else None)


def train_command(
    contestant: Contestant, run_dir: Path, seed: int, steps: int, every: int, extra: list[str]
) -> list[str]:
    """The `odrl train` command of one run: the race's overrides (`extra`), then the contestant's own
    (a variant's lr wins over a shared one), then the race's fixed settings."""
    args = [*extra, *contestant.overrides, f"train.output_dir={run_dir}", f"train.steps={steps}"]
    args += [f"train.seed={seed}", f"eval.every={every}", "train.overwrite=true", "train.progress=false"]
    args += ["train.preview_every=0", "train.checkpoint_every=0", "tracking.wandb=false"]
    return [sys.executable, "-m", "omni_diffusion_rl.cli", "train", contestant.config, *args]


def _train(
    contestant: Contestant,
    run_dir: Path,
    seed: int,
    steps: int,
    every: int,
    extra: list[str],
    threads: int,
    started: Callable[[subprocess.Popen[str]], None] | None = None,
) -> None:
    command = train_command(contestant, run_dir, seed, steps, every, extra)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    done = run_process_tree(command, timeout_s=LAUNCH_TIMEOUT_S, env=env, started=started)
    if done.returncode != 0:
        raise RuntimeError(f"race run {run_dir.name} failed:\n{done.stderr[-3000:]}")


def _spreads(per: dict[str, Any], threshold: float) -> dict[str, dict[str, bool | None]]:
    """For each contestant against nft: do the final accuracies and the times to `threshold` overlap
    over seeds (True: the difference is within the seed spread)."""
    if "nft" not in per:
        return {}
    key, ref = f"to_{threshold:g}", per["nft"]
    return {
        name: {
            "final_accuracy": overlaps(row["final_accuracy"], ref["final_accuracy"]),
            f"seconds_{key}": overlaps(row[key]["seconds"], ref[key]["seconds"]),
        }
        for name, row in per.items()
        if name != "nft"
    }


def _cell(r: dict[str, float] | None, digits: int = 0) -> str:
    if r is None:
        return "-"
    return f"{r['median']:.{digits}f} [{r['min']:.{digits}f}-{r['max']:.{digits}f}]"


def format_table(result: dict[str, Any]) -> str:
    """Markdown: per contestant, time and samples to each threshold, final accuracy and health."""
    thresholds = result["thresholds"]
    heads = [f"s to {t:g}" for t in thresholds] + [f"samples to {t:g}" for t in thresholds]
    lines = [
        "| algorithm | "
        + " | ".join(heads)
        + " | final accuracy | "
        + " | ".join(h.replace("_", " ") for h in HEALTH)
        + " |",
        "|---" * (len(heads) + 2 + len(HEALTH)) + "|",
    ]
    for name, row in result["per_contestant"].items():
        cells = []
        for kind in ("seconds", "samples"):
            for t in thresholds:
                r = row[f"to_{t:g}"]
                text = _cell(r[kind])
                if r["reached"] < row["seeds"]:
                    text += f" ({r['reached']}/{row['seeds']} seeds)"
                cells.append(text)
        health = [_cell(row["final_health"][h], HEALTH_DIGITS.get(h, 2)) for h in HEALTH]
        lines.append(
            f"| {name} | "
            + " | ".join(cells)
            + f" | {_cell(row['final_accuracy'], 3)} | "
            + " | ".join(health)
            + " |"
        )
    lines.append("")
    lines.append(
        "Median [range] over seeds; seconds are training seconds (evaluations excluded), "
        f"{result.get('jobs', 1)} run(s) at a time, {result.get('threads_per_run', '?')} thread(s) each."
    )
    for threshold, h in result["headline"].items():
        if not h:
            continue
        ratio = "-" if h["ratio"] is None else f"{h['ratio']}x"
        detail = (
            f"range over seeds {h['range']}" if "range" in h else f"seeds that reached it: {h.get('reached')}"
        )
        lines.append(f"Flow-GRPO's time to {threshold} over DiffusionNFT's: {h['kind']} {ratio} ({detail}).")
    return "\n".join(lines)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    for ax, kind, label in (
        (axes[0], "seconds", "training seconds"),
        (axes[1], "samples", "generated samples"),
    ):
        for i, (name, curves) in enumerate(result["curves"].items()):
            color = f"C{i}"
            for j, curve in enumerate(curves):
                ax.plot(
                    [p[kind] for p in curve],
                    [p["accuracy"] for p in curve],
                    color=color,
                    alpha=0.8,
                    label=name if j == 0 else None,
                )
        for t in result["thresholds"]:
            ax.axhline(t, color="grey", lw=0.5, ls="--")
        ax.set_xlabel(label)
        ax.set_ylabel("held-out accuracy, all attributes (judge)")
        ax.set_ylim(0, 1)
    axes[0].legend(fontsize=8)
