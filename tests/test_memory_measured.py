"""The measured memory benchmark (`odrl bench memory --measure`): which launches it makes, its
verdicts, the tiny families' width knob, and a small measurement (the tiny built-in model at 1 and
2 processes) whose sharded rows hold half the frozen base, gradients and AdamW state per process."""

from __future__ import annotations

import contextlib
import io
import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from omni_diffusion_rl.benchmarks.memory_measured import (
    FIGURES,
    Case,
    add_base_fractions,
    family_run,
    measure_case,
    measured_cases,
    run_memory_measurement,
    scaling_verdicts,
)
from omni_diffusion_rl.benchmarks.tiny_families import tiny_h3_components, tiny_ltx2_pipeline

from .helpers import REPO

COLUMNS = ["family", "processes", "sharding", "base MiB/process", "base / 1-process", "adapters MiB"]
COLUMNS += ["grads MiB", "optimizer MiB", "other frozen MiB", "start-up RSS MiB", "peak RSS MiB"]


def test_every_process_count_is_measured_with_and_without_sharding_one_process_once() -> None:
    cases = measured_cases(["tiny_av"], [4, 1, 2])
    assert cases == [
        Case("tiny_av", 1, "none"),
        Case("tiny_av", 2, "none"),
        Case("tiny_av", 2, "fsdp"),
        Case("tiny_av", 4, "none"),
        Case("tiny_av", 4, "fsdp"),
    ]


def test_the_verdict_compares_the_sharded_base_with_one_nth_of_one_process() -> None:
    rows = [
        {"family": "f", "processes": 1, "sharding": "none", "base_bytes": 1000},
        {"family": "f", "processes": 2, "sharding": "none", "base_bytes": 1000},
        {"family": "f", "processes": 2, "sharding": "fsdp", "base_bytes": 540},
        {"family": "f", "processes": 4, "sharding": "fsdp", "base_bytes": 280},
    ]
    add_base_fractions(rows)
    assert [r["base_fraction"] for r in rows] == [1.0, 1.0, 0.54, 0.28]
    verdicts = scaling_verdicts(rows)["f"]
    assert verdicts["2"]["within_tolerance"] and verdicts["2"]["relative_error"] == pytest.approx(0.08)
    assert not verdicts["4"]["within_tolerance"], "0.28 is 12% over 1/4"


@pytest.mark.parametrize(("processes", "families"), [((1, 2), ("tiny_av", "sd3")), ((0, 2), ("tiny_av",))])
def test_an_unknown_family_or_process_count_is_refused_before_anything_runs(
    tmp_path: Path, processes: tuple[int, ...], families: tuple[str, ...]
) -> None:
    with pytest.raises(ValueError, match="choose among|at least 1"):
        run_memory_measurement(tmp_path / "out.json", processes, families)
    assert not (tmp_path / "out.json").exists()


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def test_the_width_knob_widens_the_transformers_only() -> None:
    narrow, wide = tiny_ltx2_pipeline(), tiny_ltx2_pipeline(width=64)
    assert _count(wide.transformer) > 4 * _count(narrow.transformer)
    for name in ("vae", "audio_vae", "text_encoder", "connectors", "vocoder"):
        assert _count(getattr(wide, name)) == _count(getattr(narrow, name)), name
    narrow, wide = tiny_h3_components(), tiny_h3_components(width=64)
    assert _count(wide["transformer"]) > 2 * _count(narrow["transformer"])
    for name in ("vae", "audio_vae", "text_encoder"):
        assert _count(wide[name]) == _count(narrow[name]), name


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict], dict, str]:
    """The tiny built-in model at 1 and 2 processes: the rows, the JSON and the printed output."""
    output = tmp_path_factory.mktemp("memory") / "memory_measured.json"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        rows = run_memory_measurement(
            output, (1, 2), ("tiny_av",), tiny_config=REPO / "recipes" / "configs" / "tiny_t2av_nft.yaml"
        )
    return rows, json.loads(output.read_text()), printed.getvalue()


@pytest.mark.slow
def test_the_json_and_the_table_have_every_column(measured: tuple[list[dict], dict, str]) -> None:
    rows, result, printed = measured
    assert [(r["family"], r["processes"], r["sharding"]) for r in rows] == [
        ("tiny_av", 1, "none"),
        ("tiny_av", 2, "none"),
        ("tiny_av", 2, "fsdp"),
    ]
    assert result["rows"] == rows
    for row in rows:
        assert all(isinstance(row[f"{k}_bytes"], int) for k in FIGURES), row
        assert row["base_bytes"] > 0 and row["peak_rss_bytes"] >= row["startup_rss_bytes"] > row["base_bytes"]
        assert len(row["ranks"]) == row["processes"]
    header = next(line for line in printed.splitlines() if line.startswith("| family"))
    assert [cell.strip() for cell in header.strip("|").split("|")] == COLUMNS
    table_rows = [line for line in printed.splitlines() if line.startswith("| tiny_av")]
    assert len(table_rows) == len(rows)


@pytest.mark.slow
def test_sharding_halves_the_frozen_base_gradients_and_optimizer_state(
    measured: tuple[list[dict], dict, str],
) -> None:
    rows, result, _ = measured
    single, whole, sharded = rows
    assert whole["base_bytes"] == single["base_bytes"], "unsharded: every process holds the whole base"
    assert sharded["base_bytes"] == pytest.approx(single["base_bytes"] / 2, rel=0.10)
    assert result["memory_scales"]["tiny_av"]["2"]["within_tolerance"]
    for figure in ("adapters", "grads", "optimizer"):
        assert whole[f"{figure}_bytes"] == single[f"{figure}_bytes"], figure
        assert sharded[f"{figure}_bytes"] == pytest.approx(whole[f"{figure}_bytes"] / 2, rel=0.10), figure
    assert sharded["other_frozen_bytes"] == whole["other_frozen_bytes"], "VAEs etc. stay whole"
    assert all(rank["sharded"] for rank in sharded["ranks"]) and not any(r["sharded"] for r in whole["ranks"])


def _alive(pid: int) -> bool:
    """Whether a process of this user has that id (a zombie counts: nobody reaped it)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process took the number
        return False
    return True


@pytest.mark.slow
def test_every_launched_process_is_gone(measured: tuple[list[dict], dict, str]) -> None:
    rows, _, _ = measured
    pids = [pid for row in rows for pid in row["pids"]]
    assert len(pids) == 1 + 2 + 2
    assert not [pid for pid in pids if _alive(pid)]


def _processes_naming(text: str) -> list[int]:
    """Ids of this machine's processes whose command line contains `text` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
        except OSError:  # it ended meanwhile
            continue
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc").is_dir(), reason="lists processes through /proc")
def test_a_launch_past_its_timeout_is_stopped_with_all_its_processes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step whose reward sleeps 10 minutes does not end in time: the launch is stopped at its
    timeout, and neither the launcher nor its 2 workers (each names `tmp_path` on its command line)
    is left."""
    config, overrides = family_run("tiny_av", tmp_path, REPO / "recipes" / "configs" / "tiny_t2av_nft.yaml")
    monkeypatch.setenv("ODRL_TEST_SLOW_S", "600")  # the launched workers inherit it
    plugin = REPO / "tests" / "plugin_rewards.py"
    endless = [*overrides, f"reward.plugins=[{plugin}]", "reward.weights={test_slow: 1.0}"]
    with pytest.raises(RuntimeError, match="ran past 20 s and was stopped"):
        measure_case(Case("tiny_av", 2, "none"), config, endless, tmp_path, timeout_s=20)
    deadline = time.monotonic() + 120  # a worker killed before it armed its lifeline exits when it does
    while _processes_naming(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _processes_naming(str(tmp_path))
