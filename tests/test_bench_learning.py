"""The learning benchmark: the within-noise rule, and a small 2-process run of two modes end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.learning import (
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


def test_learning_bench_runs_two_modes_and_two_algorithms_over_two_seeds(tmp_path: Path) -> None:
    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "unused", 1)
    output = tmp_path / "bench" / "learning.json"
    modes = ("colocated", "raft:separate")  # NFT colocated against RAFT in separate mode
    result = run_learning_bench(output, None, overrides, modes=modes, seeds=(0, 1), steps=2)
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result))
    assert output.with_suffix(".png").is_file()
    assert report["steps_per_run"] == 2 and report["seeds"] == [0, 1]
    assert report["modes"] == ["colocated", "raft:separate"] and report["max_staleness"] == 1
    assert [(r["mode"], r["seed"]) for r in report["runs"]] == [
        ("colocated", 0),
        ("colocated", 1),
        ("raft:separate", 0),
        ("raft:separate", 1),
    ]
    raft_log = (output.parent / "learning_raft_separate_seed0" / "metrics.jsonl").read_text()
    assert (
        "loss/flow_matching" in raft_log
        and "loss/flow_matching"
        not in (output.parent / "learning_colocated_seed0" / "metrics.jsonl").read_text()
    )
    for run in report["runs"]:
        assert run["samples_trained"] == 2 * 2 * 2
        assert sum(run["staleness_histogram"].values()) == run["samples_trained"]
        assert run["max_lag"] <= run["max_staleness"] and run["staleness_within_bound"] is True
        assert math.isfinite(run["heldout_reward_after"]) and run["seconds_per_trained_prompt"] > 0
    assert report["runs"][0]["max_lag"] == 0, "colocated trains on its current policy"
    assert set(report["per_mode"]) == {"colocated", "raft:separate"}
    for mode, row in report["per_mode"].items():
        assert row["n"] == 2 and len(row["heldout_reward_after"]) == 2
        assert row["std"] >= 0 and row["noise_band"] >= 0
        assert isinstance(row["within_noise"], bool), mode
        assert row["staleness_within_bound"] is True
    colocated = report["per_mode"]["colocated"]
    assert colocated["diff_to_colocated"] == 0 and colocated["within_noise"] is True
    assert isinstance(report["all_within_noise"], bool)
    assert report["staleness_within_bound"] is True
    assert "2 * sqrt" in report["rule"]
