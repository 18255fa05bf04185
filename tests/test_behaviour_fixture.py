"""Behaviour pinned before the algorithm/execution redesign: every logged step value, bit for bit.

A colocated run of the tiny demo config with a fixed seed, and a 2-process separate run whose
schedule is deterministic (staleness bound 0, `wait`), must log exactly the values recorded in
tests/fixtures/behaviour_before_seam.json (timings, idle seconds and the buffer's depth, which
depend on the clock, are left out). A refactor that changes what the loop computes fails here.
Re-record (only for an intended change of behaviour, saying why in the commit) with
ODRL_RECORD_BEHAVIOUR=1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_diffusion_rl.subprocesses import run_process_tree

from .helpers import ENV, REPO, odrl

FIXTURE = Path(__file__).parent / "fixtures" / "behaviour_before_seam.json"
RECORD = os.environ.get("ODRL_RECORD_BEHAVIOUR") == "1"
CLOCK_KEYS = ("time/", "idle/", "rollout/seconds_per_group", "buffer/depth")
SMALL = [
    str(REPO / "recipes" / "configs" / "tiny_t2av_nft.yaml"),
    "train.steps=4",
    "data.prompts_per_step=4",
    "data.group_size=4",
    "train.eval_at_start_and_end=false",
    "train.preview_every=0",
    "train.progress=false",
    "tracking.wandb=false",
]
RUN_ENV = {**ENV, "OMP_NUM_THREADS": "1"}  # one thread: reductions in one order on every machine


def logged_values(run_dir: Path) -> list[dict[str, float]]:
    """Each step's record without the values that depend on the clock."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if not k.startswith(CLOCK_KEYS)} for row in rows if "step" in row]


def check_or_record(name: str, values: list[dict[str, float]]) -> None:
    recorded = json.loads(FIXTURE.read_text()) if FIXTURE.is_file() else {}
    if RECORD:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps({**recorded, name: values}, indent=1, sort_keys=True) + "\n")
        return
    assert name in recorded, f"no recorded behaviour for {name}: record it with ODRL_RECORD_BEHAVIOUR=1"
    expected = recorded[name]
    assert [r["step"] for r in values] == [r["step"] for r in expected]
    for got, want in zip(values, expected, strict=True):
        assert got == want, {
            k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)
        }


def test_colocated_logs_the_recorded_values(tmp_path: Path) -> None:
    run = tmp_path / "run"
    done = subprocess.run(
        odrl("train", *SMALL, f"train.output_dir={run}"),
        capture_output=True,
        text=True,
        env=RUN_ENV,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    check_or_record("colocated", logged_values(run))


@pytest.mark.slow
def test_deterministic_separate_logs_the_recorded_values(tmp_path: Path) -> None:
    run = tmp_path / "run"
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    launch += ["--main_process_port", "29613", str(REPO / "recipes" / "train_nft.py")]
    overrides = ["execution.mode=separate", "execution.max_staleness=0", "execution.on_stale=wait"]
    done = run_process_tree(
        [*launch, *SMALL, f"train.output_dir={run}", *overrides],
        timeout_s=300,
        env={**RUN_ENV, "ACCELERATE_USE_CPU": "true"},
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    values = logged_values(run)
    assert all(r["staleness/max"] == 0 for r in values)
    check_or_record("separate_staleness_0", values)
