"""tests/tools/process_census.py: its start-up hook writes a line per process, its report adds them up."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import ENV
from .tools.process_census import HOOK, HOOK_MODULE, kind, report


def test_commands_are_grouped_by_what_they_run() -> None:
    assert kind(["-m", "omni_diffusion_rl.cli", "train", "--nproc", "2"]) == "odrl train"
    assert kind(["-u", "-m", "omni_diffusion_rl.cli", "--flag"]) == "-m omni_diffusion_rl.cli"
    assert kind(["-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"]) == "pytest worker"
    assert kind(["/repo/recipes/train_nft.py", "a=b"]) == "train_nft.py"


def test_the_report_adds_up_each_kind(tmp_path: Path) -> None:
    log = tmp_path / "census.jsonl"
    rows = [
        {"argv": ["-m", "omni_diffusion_rl.cli", "train"], "wall_s": 5.0, "cpu_s": 4.0, "test": "a"},
        {"argv": ["-m", "omni_diffusion_rl.cli", "train"], "wall_s": 3.0, "cpu_s": 2.5, "test": "b"},
        {"argv": ["-m", "accelerate.commands.launch"], "wall_s": 9.0, "cpu_s": 1.0, "test": "b"},
    ]
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    table = report(log)
    assert list(table) == ["odrl train", "-m accelerate.commands.launch"], "most CPU first"
    assert table["odrl train"] == {"processes": 2, "cpu_s": 6.5, "wall_s": 8.0}


@pytest.mark.slow  # starts an interpreter
def test_the_hook_writes_one_line_when_a_process_exits(tmp_path: Path) -> None:
    (tmp_path / f"{HOOK_MODULE}.py").write_text(HOOK)
    log = tmp_path / "census.jsonl"
    env = {**ENV, "PYTHONPATH": str(tmp_path), "ODRL_PROC_LOG": str(log), "PYTEST_CURRENT_TEST": "t"}
    subprocess.run([sys.executable, "-c", f"import {HOOK_MODULE}; print(1)"], env=env, check=True, timeout=60)
    (line,) = log.read_text().splitlines()
    row = json.loads(line)
    assert row["argv"][0] == "-c" and row["test"] == "t" and row["cpu_s"] >= 0 and row["wall_s"] >= 0
