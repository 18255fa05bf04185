"""The learning benchmark: the within-noise rule, its pooling of seeds per mode (on hand-made runs),
and a small 2-process run of two modes and two algorithms end to end (one seed: each run costs the
launcher's and its processes' start-up, and a second seed takes no other path)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.learning import (
    RULE,
    _draw,
    _run_record,
    compare_modes,
    format_table,
    max_lag,
    mean_std,
    noise_band,
    run_learning_bench,
    within_noise,
)

from .helpers import fast_overrides, tiny_model_dir

pytestmark = pytest.mark.slow  # multi-process runs: left out of `make test-fast`


def test_within_noise_rule_on_hand_made_numbers() -> None:
    mean, std = mean_std([1.0, 2.0, 3.0])
    assert mean == 2.0 and std == 1.0
    assert mean_std([0.5]) == (0.5, 0.0)
    # band: 2 * sqrt(1/4 + 1/4) = sqrt(2)
    assert noise_band(1.0, 4, 1.0, 4) == pytest.approx(math.sqrt(2))
    assert within_noise(1.4, 1.0, 4, 0.0, 1.0, 4)
    assert within_noise(-1.4, 1.0, 4, 0.0, 1.0, 4)
    assert not within_noise(1.5, 1.0, 4, 0.0, 1.0, 4)
    # unequal spreads and counts: 2 * sqrt(0.04/1 + 0.09/9) = 2 * sqrt(0.05)
    assert within_noise(0.44, 0.2, 1, 0.0, 0.3, 9)
    assert not within_noise(0.45, 0.2, 1, 0.0, 0.3, 9)
    # no spread at all: only a tie is within noise
    assert within_noise(0.3, 0.0, 3, 0.3, 0.0, 3)
    assert not within_noise(0.3001, 0.0, 3, 0.3, 0.0, 3)
    assert max_lag({"0": 4, "1": 4}) == 1
    assert max_lag({"0": 2, "2": 0}) == 0 and max_lag({}) == 0


def _summary(after: float, trained: int = 8, histogram: dict[int, int] | None = None) -> dict:
    """A run's summary as `odrl train` prints it, with the figures the learning bench reads."""
    summary = {
        "heldout_reward_before": 0.5,
        "heldout_reward_after": after,
        "heldout_gain": after - 0.5,
        "samples": {"trained": trained},
        "seconds": 1.0,
        "seconds_per_trained_prompt": 0.25,
    }
    if histogram is not None:  # a mode with a buffer (separate, hybrid)
        summary["execution"] = {"buffer": {"staleness_histogram": histogram}}
    return summary


def test_two_seeds_of_a_mode_are_pooled_by_the_rule(tmp_path: Path) -> None:
    """Two seeds per mode (the end-to-end run has one): the mean and sample std over seeds, the
    band of the rule, the table's n and the plot with a dot per seed."""
    from omni_diffusion_rl.benchmarks.common import publish

    runs = [
        _run_record("colocated", 0, _summary(0.6), 4, 1),
        _run_record("colocated", 1, _summary(0.8), 4, 1),
        _run_record("raft:separate", 0, _summary(0.9, histogram={0: 6, 1: 2}), 4, 1),
        _run_record("raft:separate", 1, _summary(1.1, histogram={0: 8}), 4, 1),
    ]
    assert runs[0]["staleness_histogram"] == {"0": 8} and runs[2]["max_lag"] == 1
    per_mode = compare_modes(["colocated", "raft:separate"], runs)
    colocated, raft = per_mode["colocated"], per_mode["raft:separate"]
    assert colocated["n"] == raft["n"] == 2 and raft["heldout_reward_after"] == [0.9, 1.1]
    assert colocated["mean"] == pytest.approx(0.7) and colocated["std"] == pytest.approx(math.sqrt(0.02))
    assert raft["mean"] == pytest.approx(1.0) and raft["max_lag"] == 1
    assert raft["noise_band"] == pytest.approx(2 * math.sqrt(0.02 / 2 + 0.02 / 2))  # = 0.2828
    assert raft["diff_to_colocated"] == pytest.approx(0.3) and raft["within_noise"] is False
    assert colocated["diff_to_colocated"] == 0 and colocated["within_noise"] is True
    result = {
        "steps_per_run": 2,
        "seeds": [0, 1],
        "max_staleness": 1,
        "runs": runs,
        "per_mode": per_mode,
        "staleness_within_bound": True,
    }
    table = format_table(result)
    assert "seeds 0,1" in table and RULE in table and "OUTSIDE noise" in table
    assert [line.split()[1] for line in table.splitlines()[3:5]] == ["2", "2"]  # n per mode
    output = tmp_path / "learning.json"
    publish(result, output, table, _draw, (5.2, 3.4))
    assert output.with_suffix(".png").stat().st_size > 0


def test_learning_bench_runs_two_modes_and_two_algorithms(tmp_path: Path) -> None:
    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "unused", 1)
    output = tmp_path / "bench" / "learning.json"
    modes = ("colocated", "raft:separate")  # NFT colocated against RAFT in separate mode
    result = run_learning_bench(output, None, overrides, modes=modes, seeds=(1,), steps=2)
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result))
    assert output.with_suffix(".png").is_file()
    assert report["steps_per_run"] == 2 and report["seeds"] == [1]
    assert report["modes"] == ["colocated", "raft:separate"] and report["max_staleness"] == 1
    assert [(r["mode"], r["seed"]) for r in report["runs"]] == [("colocated", 1), ("raft:separate", 1)]
    raft_log = (output.parent / "learning_raft_separate_seed1" / "metrics.jsonl").read_text()
    assert (
        "loss/flow_matching" in raft_log
        and "loss/flow_matching"
        not in (output.parent / "learning_colocated_seed1" / "metrics.jsonl").read_text()
    )
    for run in report["runs"]:
        assert run["samples_trained"] == 2 * 2 * 2
        assert sum(run["staleness_histogram"].values()) == run["samples_trained"]
        assert run["max_lag"] <= run["max_staleness"] and run["staleness_within_bound"] is True
        assert math.isfinite(run["heldout_reward_after"]) and run["seconds_per_trained_prompt"] > 0
    assert report["runs"][0]["max_lag"] == 0, "colocated trains on its current policy"
    assert set(report["per_mode"]) == {"colocated", "raft:separate"}
    for mode, row in report["per_mode"].items():
        assert row["n"] == 1 and len(row["heldout_reward_after"]) == 1
        assert row["std"] == 0 and row["noise_band"] == 0  # one seed: only a tie is within noise
        assert isinstance(row["within_noise"], bool), mode
        assert row["staleness_within_bound"] is True
    colocated = report["per_mode"]["colocated"]
    assert colocated["diff_to_colocated"] == 0 and colocated["within_noise"] is True
    raft = report["per_mode"]["raft:separate"]
    assert raft["within_noise"] is (raft["heldout_reward_after"] == colocated["heldout_reward_after"])
    assert isinstance(report["all_within_noise"], bool)
    assert report["staleness_within_bound"] is True
    assert "2 * sqrt" in report["rule"]
