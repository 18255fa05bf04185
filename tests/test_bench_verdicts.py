"""How the benchmarks state a comparison on a noisy machine: paired by round, a verdict only when
every round agrees, otherwise "within noise"; and the modes bench's round order."""

from __future__ import annotations

import pytest

from omni_diffusion_rl.benchmarks.common import compare_paired, spread
from omni_diffusion_rl.benchmarks.modes import RUN_MODES, round_order


def test_a_comparison_is_a_verdict_only_when_every_round_agrees() -> None:
    assert compare_paired([0.9, 0.8, 0.95], [1.0, 1.0, 1.0])["verdict"] == "faster"
    assert compare_paired([1.1, 1.2, 1.05], [1.0, 1.0, 1.0])["verdict"] == "slower"
    mixed = compare_paired([0.9, 1.1, 1.0], [1.0, 1.0, 1.0])
    assert mixed["verdict"] == "within noise"
    assert (mixed["min"], mixed["max"]) == (pytest.approx(-0.1), pytest.approx(0.1))
    assert mixed["each_round"] == [pytest.approx(-0.1), pytest.approx(0.1), 0.0]


def test_a_target_is_met_missed_or_within_noise() -> None:
    assert compare_paired([1.02, 1.04], [1.0, 1.0], at_most=0.05)["verdict"] == "met"
    assert compare_paired([1.08, 1.2], [1.0, 1.0], at_most=0.05)["verdict"] == "missed"
    assert compare_paired([1.02, 1.12], [1.0, 1.0], at_most=0.05)["verdict"] == "within noise"


def test_pairs_must_match() -> None:
    with pytest.raises(ValueError):
        compare_paired([1.0, 2.0], [1.0])


def test_spread_reports_median_range_and_relative_range() -> None:
    assert spread([0.3, 0.2, 0.4]) == {"median": 0.3, "min": 0.2, "max": 0.4, "relative_range": 0.6667}


def test_each_mode_opens_one_round_in_turn() -> None:
    rounds = [round_order(i) for i in range(len(RUN_MODES))]
    assert all(sorted(r) == sorted(RUN_MODES) for r in rounds)
    assert [r[0] for r in rounds] == list(RUN_MODES) and [r[-1] for r in rounds] != [rounds[0][-1]] * 4
