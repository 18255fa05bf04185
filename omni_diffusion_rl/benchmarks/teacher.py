"""`odrl bench teacher`: what the asynchronous teacher schedule hides, and what a second teacher
replica adds.

1. Schedule: the same colocated distillation run three ways, in interleaved rounds: the teacher
   asked on its own thread while the next chunk generates and this one is scored
   (teacher.overlap=true); also one step off (teacher.one_step_off=true: the next step's rollouts
   are made before this step trains, so their targets come while it trains, and each step trains
   on rollouts one update old); and blocking after each chunk (teacher.overlap=false, the reference
   release's schedule). Reported: steady seconds per trained sample of each, the teacher's own
   seconds, the wait for targets, the staleness, and the share of the blocking run's teacher time
   each schedule hid: (blocking - schedule) / teacher seconds per step. Twice: the teacher in the
   training process (its compute shares the host's cores with training, so on a small CPU host no
   schedule can hide all of it), and the same teacher as an `odrl serve-teacher` process on one
   thread with a fixed SERVER_SERVICE_MS per batch (a remote accelerator's stand-in, as on a
   cluster where teachers have their own devices).
2. Replicas: teacher throughput (states per second) through 1 and 2 `odrl serve-teacher` processes
   on 127.0.0.1, compute-bound and with `--service-ms` (a fixed time per batch standing in for a
   remote accelerator: on 2 CPU cores two compute-bound replicas share the same cores). Each server
   computes on its thread budget (`--threads`, so an OMP_NUM_THREADS in the environment does not
   oversubscribe the host): each of the two on half of the host's cores, against one replica on the
   same half (the scaling: what a second replica adds) and one on all of them (what splitting the
   host buys); the report states the budgets and the cores the client (this process) used.

`parts` (`odrl bench teacher --parts replicas`) runs one of the two.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from ..runtime.threads import thread_share
from .common import DEFAULT_CONFIG, QUIET, compare_paired, machine_info, median, spread

SERVER_SERVICE_MS = 100  # the schedules' teacher server: a fixed time per batch (a remote accelerator)
PARTS = ("schedules", "replicas")
SCHEDULES = {
    "overlap": ("teacher.overlap=true",),
    "one_step_off": ("teacher.overlap=true", "teacher.one_step_off=true"),
    "blocking": ("teacher.overlap=false",),
}
# The replicas' loads: each its own three servers (the extra arguments of every one).
REPLICA_LOADS = {
    "compute-bound": (),
    "service 100 ms per batch (remote accelerator stand-in)": ("--service-ms", "100"),
}


def _schedule_run(
    config: str | None, overrides: list[str], schedule: str, steps: int, run: Path
) -> dict[str, float]:
    from ..config import load_config
    from ..trainers.trainer import Trainer

    cfg = load_config(
        config,
        [
            *overrides,
            *QUIET,
            "algorithm.name=distill",
            *SCHEDULES[schedule],
            f"train.steps={steps}",
            f"train.output_dir={run}",
        ],
    )
    trainer = Trainer(cfg)
    summary = trainer.fit()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in rows if "teacher/seconds" in r][1:]  # the first step warms up
    samples = cfg.data.prompts_per_step * cfg.data.group_size
    return {
        "s_per_sample": median(
            [r["time/sec_per_prompt"] * cfg.data.prompts_per_step / samples for r in steady]
        ),
        "teacher_s_per_step": median([r["teacher/seconds"] for r in steady]),
        "teacher_wait_s_per_step": median([r["teacher/wait_s"] for r in steady]),
        "step_s": median([r["time/sec_per_prompt"] * cfg.data.prompts_per_step for r in steady]),
        "staleness": median([r.get("experience/staleness", 0.0) for r in steady]),
        "trained": float(summary["samples"]["trained"]),
    }


def _throughput(urls: list[str], states: int, request_samples: int) -> tuple[float, float]:
    """States per second through the servers at `urls`, and the cores this (client) process used
    meanwhile: CPU seconds over wall seconds, its encoding, sending and decoding of the requests."""
    import torch

    from ..serving.teacher_client import RemoteTeacher

    teacher = RemoteTeacher(urls, request_samples=request_samples, window=2)
    shape = teacher.info().latent_shape
    x, t = torch.randn(states, *shape), torch.rand(states)
    prompts = ["a red circle with a low tone at the start"] * states
    warm = request_samples * len(urls)  # one request for every replica: none starts cold in the timing
    teacher.velocity(x[:warm], t[:warm], prompts[:warm])
    started, cpu_started = time.perf_counter(), time.process_time()
    teacher.velocity(x, t, prompts)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    teacher.close()
    return states / seconds, cpu / seconds


def _schedule_bench(
    config: str | None, overrides: list[str], steps: int, repeats: int, base: Path
) -> dict[str, Any]:
    """The three schedules in interleaved rounds, each round opened by the other end."""
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in SCHEDULES}
    for k in range(repeats):
        order = list(SCHEDULES) if k % 2 == 0 else list(reversed(SCHEDULES))
        for name in order:
            rounds[name].append(_schedule_run(config, overrides, name, steps, base / f"{name}_{k}"))
    blocking = rounds["blocking"]
    schedule: dict[str, Any] = {
        name: {key: spread([r[key] for r in runs]) for key in runs[0]} for name, runs in rounds.items()
    }
    for name in ("overlap", "one_step_off"):
        runs = rounds[name]
        schedule[f"{name}_vs_blocking_s_per_sample"] = compare_paired(
            [r["s_per_sample"] for r in runs], [r["s_per_sample"] for r in blocking]
        )
        schedule[f"hidden_share_of_teacher_time_{name}"] = spread(
            [
                (b["step_s"] - r["step_s"]) / b["teacher_s_per_step"]
                for r, b in zip(runs, blocking, strict=True)
            ]
        )
    return schedule


def run_teacher_bench(
    output: Path,
    config: str | None = DEFAULT_CONFIG,
    overrides: list[str] | None = None,
    steps: int = 12,
    repeats: int = 3,
    states: int = 512,
    parts: tuple[str, ...] = PARTS,
    replica_loads: tuple[str, ...] = tuple(REPLICA_LOADS),
) -> dict[str, Any]:
    """The `parts` asked for (both by default), the replicas under the `replica_loads` named (every
    one of REPLICA_LOADS by default); prints a table, writes JSON."""
    from ..config import load_config

    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        raise ValueError(f"odrl bench teacher: parts must be some of {', '.join(PARTS)}; got {list(parts)}")
    if set(replica_loads) - set(REPLICA_LOADS) or not replica_loads:
        raise ValueError(
            f"odrl bench teacher: replica_loads must be some of {', '.join(REPLICA_LOADS)}; "
            f"got {list(replica_loads)}"
        )
    overrides = ["sampling.rollout_chunks=2", *(overrides or [])]  # chunks: what the teacher overlaps with
    base = output.parent / "teacher_runs"
    teacher = load_config(config, overrides).teacher
    if teacher.urls or teacher.routes:
        raise ValueError(
            "odrl bench teacher runs the teacher in process and as its own server: drop the "
            "teacher.urls and teacher.routes overrides"
        )
    result: dict[str, Any] = {"machine": machine_info(), "steps": steps, "repeats": repeats}
    if "schedules" in parts:
        result |= _schedules_in_process_and_served(config, overrides, steps, repeats, base, teacher)
    if "replicas" in parts:
        result["replicas"] = _replica_bench(states, repeats, replica_loads)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(_table(result))
    print(f"wrote {output}")
    return result


def _schedules_in_process_and_served(
    config: str | None, overrides: list[str], steps: int, repeats: int, base: Path, teacher: Any
) -> dict[str, Any]:
    """The schedules with the teacher in process, then as a server at SERVER_SERVICE_MS per batch."""
    from ..serving.process import ServerProcess

    schedule = _schedule_bench(config, overrides, steps, repeats, base / "in_process")
    with ServerProcess(
        [teacher.name],
        "--options",
        json.dumps(teacher.options),
        "--max-batch",
        "64",
        "--threads",
        "1",
        "--service-ms",
        str(SERVER_SERVICE_MS),
        command="serve-teacher",
    ) as server:
        served = [*overrides, f"teacher.urls=[{server.url}]"]
        schedule_server = _schedule_bench(config, served, steps, repeats, base / "server")
    return {
        "schedule": schedule,
        "schedule_teacher_server": {"service_ms_per_batch": SERVER_SERVICE_MS, **schedule_server},
    }


def _replica_bench(states: int, repeats: int, loads: tuple[str, ...]) -> dict[str, Any]:
    """States per second through one and two teacher servers, interleaved rounds, under each load."""
    from ..serving.process import ServerProcess

    replicas: dict[str, Any] = {}
    serve: dict[str, Any] = {"command": "serve-teacher"}
    for label in loads:
        extra = REPLICA_LOADS[label]
        alone, shared = ["--threads", str(thread_share(1))], ["--threads", str(thread_share(2))]
        with (
            ServerProcess(["policy"], "--max-batch", "16", *alone, *extra, **serve) as solo,
            ServerProcess(["policy"], "--max-batch", "16", *shared, *extra, **serve) as one,
            ServerProcess(["policy"], "--max-batch", "16", *shared, *extra, **serve) as two,
        ):
            single, half, double = [], [], []
            client: dict[str, list[float]] = {"1 replica": [], "2 replicas": []}
            arms = [
                (single, [solo.url], "1 replica"),
                (half, [one.url], None),
                (double, [one.url, two.url], "2 replicas"),
            ]
            for round_ in range(repeats):  # interleaved, each round in the other order
                for measured, urls, arm in arms if round_ % 2 == 0 else arms[::-1]:
                    per_s, client_cores = _throughput(urls, states, 16)
                    measured.append(per_s)
                    if arm is not None:
                        client[arm].append(client_cores)
        replicas[label] = {
            "1 replica states/s": spread(single),
            "1 replica on the share of each of 2 states/s": spread(half),
            "2 replicas states/s": spread(double),
            "speed-up": spread([d / s for s, d in zip(single, double, strict=True)]),
            "scaling": spread([d / h for h, d in zip(half, double, strict=True)]),
            "threads": {"1 replica": solo.ready["threads"], "2 replicas, each": one.ready["threads"]},
            "client cores": {arm: spread(cores) for arm, cores in client.items()},
        }
    return replicas


def _table(result: dict[str, Any]) -> str:
    lines = _schedule_table(result) if "schedule" in result else []
    if "replicas" in result:
        lines += _replica_table(result["replicas"])
    return "\n".join(lines)


def _schedule_table(result: dict[str, Any]) -> list[str]:
    s = result["schedule"]
    lines = [
        "| schedule | s per trained sample | teacher s per step | waited for targets s per step "
        "| staleness |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in SCHEDULES:
        r = s[name]
        lines.append(
            f"| {name} | {_fmt(r['s_per_sample'])} | {_fmt(r['teacher_s_per_step'])} | "
            f"{_fmt(r['teacher_wait_s_per_step'])} | {r['staleness']['median']:g} |"
        )
    lines.append("")
    served = result["schedule_teacher_server"]
    for where, figures in (
        ("in-process teacher (shares the host's cores)", s),
        (f"teacher server, {served['service_ms_per_batch']} ms per batch (a remote accelerator)", served),
    ):
        lines.append(f"{where}:")
        for name in ("overlap", "one_step_off"):
            versus = figures[f"{name}_vs_blocking_s_per_sample"]
            hidden = figures[f"hidden_share_of_teacher_time_{name}"]
            lines.append(
                f"  {name} vs blocking: {versus['median']:+.1%} [{versus['min']:+.1%}, {versus['max']:+.1%}] "
                f"({versus['verdict']}); teacher time hidden: {_fmt(hidden, pct=True)}; waited "
                f"{_fmt(figures[name]['teacher_wait_s_per_step'])} s per step"
            )
    lines.append("")
    return lines


def _replica_table(replicas: dict[str, Any]) -> list[str]:
    lines = [
        "| teacher servers | 1 replica states/s (all cores) | 1 replica states/s (half) | 2 replicas "
        "states/s (half each) | 2 against 1 on all cores | scaling: 2 against 1 on the same share "
        "| threads (1 / each of 2) | client cores (1 / 2 replicas) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, r in replicas.items():
        one, two = _fmt(r["1 replica states/s"]), _fmt(r["2 replicas states/s"])
        half = _fmt(r["1 replica on the share of each of 2 states/s"])
        threads = r.get("threads", {})
        budget = f"{threads.get('1 replica', '?')} / {threads.get('2 replicas, each', '?')}"
        cores = r.get("client cores", {})
        arms = ("1 replica", "2 replicas")
        client = " / ".join(f"{cores[a]['median']:.2f}" if a in cores else "?" for a in arms)
        lines.append(
            f"| {label} | {one} | {half} | {two} | {_fmt(r['speed-up'])} | {_fmt(r['scaling'])} | {budget} "
            f"| {client} |"
        )
    return lines


def _fmt(figure: dict[str, float], pct: bool = False) -> str:
    if pct:
        return f"{figure['median']:.0%} [{figure['min']:.0%}-{figure['max']:.0%}]"
    return f"{figure['median']:.3g} [{figure['min']:.3g}-{figure['max']:.3g}]"
