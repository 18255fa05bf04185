"""auto's re-check: calibrating costs with a run's own timings, and the switch rule."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.execution.planner.auto import (
    load_costs,
    predict,
    rollout_choices,
    simulate_layout,
    simulate_modes,
)
from omni_diffusion_rl.execution.planner.costs import MAX_COSTS_FILE_BYTES
from omni_diffusion_rl.execution.planner.measure import costs_to_json
from omni_diffusion_rl.execution.planner.pick import next_mode, pick_mode
from omni_diffusion_rl.execution.planner.recheck import (
    AutoRecheck,
    StepTimings,
    calibrate,
    mean_timings,
    steady_seconds,
)
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, tiny_model_dir
from .test_simulate import COSTS

POINTS = dataclasses.replace(
    COSTS, gen_points=((4, 0.2), (8, 0.3)), train_points=((16, 0.4),), points_length=10
)


@pytest.mark.parametrize("costs", [COSTS, POINTS], ids=["linear", "points"])
def test_calibrated_costs_reproduce_the_measured_timings(costs) -> None:  # noqa: ANN001
    timings = StepTimings(
        gen_samples=4, gen_s=3 * costs.gen(4), train_samples=16, train_s=costs.train(16) / 2
    )
    calibrated = calibrate(costs, timings)
    assert calibrated.gen(4) == pytest.approx(timings.gen_s)
    assert calibrated.train(16) == pytest.approx(timings.train_s)
    assert calibrated.gen(8) / calibrated.gen(4) == pytest.approx(costs.gen(8) / costs.gen(4)), "shape kept"
    with_phase = calibrate(dataclasses.replace(costs, colocated_phase_s=9.0), timings)
    assert with_phase.colocated_phase_s == 9.0, "a step does not measure the phase cost: kept"


def test_calibration_can_change_the_pick() -> None:
    cfg = load_config(None, ["data.prompts_per_step=4", "data.group_size=4"])
    phase = dataclasses.replace(COSTS, colocated_phase_s=0.5)  # colocated pays to switch phases each step
    before = predict(phase, cfg, 2)
    assert before["colocated"] > before["separate"] >= before["hybrid"]
    # generation measured 10x dearer: one rollout process cannot keep up, both colocated ones can
    after = predict(calibrate(phase, StepTimings(8, 10 * phase.gen(8), 8, phase.train(8))), cfg, 2)
    assert min(after, key=after.get) == "colocated"


def test_mean_timings() -> None:
    a, b = StepTimings(4, 1.0, 8, 2.0), StepTimings(2, 3.0, 8, 4.0)
    assert mean_timings([a, b]) == StepTimings(3, 2.0, 8, 3.0)


def test_next_mode_switches_only_past_the_margin_and_the_switch_cost() -> None:
    predicted = {"colocated": 1.0, "separate": 0.8, "hybrid": 0.85}
    assert next_mode(predicted, "separate", 100, 1.0, 0.1)[0] == "separate"
    assert next_mode(predicted, "colocated", 100, 1.0, 0.1) == (
        "separate",
        next_mode(predicted, "colocated", 100, 1.0, 0.1)[1],
    )
    inf = float("inf")
    assert next_mode({"colocated": 1.0, "separate": inf}, "separate", 10, 99.0, 0.1)[0] == "colocated"
    assert next_mode({"colocated": inf, "separate": inf}, "separate", 10, 0.0, 0.0)[0] == "separate"
    mode, why = next_mode(predicted, "colocated", 100, 25.0, 0.1)
    assert mode == "colocated" and "less than the switch" in why, "0.2 s x 100 prompts does not pay 25 s"
    mode, why = next_mode(predicted, "colocated", 100, 1.0, 0.25)
    assert mode == "colocated" and "within the margin" in why
    assert (
        next_mode({"colocated": 1.0, "separate": float("inf")}, "colocated", 10, 0.0, 0.0)[0] == "colocated"
    )


def test_auto_costs_file_formats_and_errors(tmp_path: Path) -> None:
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps({"costs": costs_to_json(POINTS), "workloads": {}}))
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps({"steps": 3, "auto": {"measured_costs": costs_to_json(POINTS)}}))
    assert load_costs(str(measured)) == load_costs(str(summary)) == POINTS
    (tmp_path / "bad.json").write_text(json.dumps({"steps": 3}))
    (tmp_path / "list.json").write_text("[1, 2]")
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe{")
    (tmp_path / "huge.json").write_bytes(b" " * (MAX_COSTS_FILE_BYTES + 1))
    for bad in ("bad.json", "missing.json", "list.json", "binary.json", "huge.json"):
        with pytest.raises(ConfigError, match="auto_costs=.*odrl simulate"):
            load_costs(str(tmp_path / bad))


def test_async_modes_are_predicted_at_their_fastest_split() -> None:
    cfg = load_config(None, ["data.prompts_per_step=4", "data.group_size=4"])
    assert rollout_choices(cfg, 4) == [2, 3] and rollout_choices(cfg, 5) == [1, 3, 4], "whole shares only"
    for gen_per_unit_s, most in ((0.02, 3), (0.0001, 2)):  # heavy generation wants more rollout processes
        costs = dataclasses.replace(COSTS, gen_per_unit_s=gen_per_unit_s)
        results = simulate_modes(costs, cfg, 4)
        for mode in ("separate", "hybrid"):
            each = {
                r: steady_seconds(simulate_layout(costs, cfg, 4, mode, r)) for r in rollout_choices(cfg, 4)
            }
            assert results[mode].pool_replicas["rollout"] == min(each, key=each.get)
        assert results["separate"].pool_replicas["rollout"] == most


def test_first_pick_prefers_colocated_unless_another_mode_is_clearly_faster() -> None:
    inf = float("inf")
    assert pick_mode({"colocated": 1.0, "separate": 0.95, "hybrid": 0.93}, 0.1) == "colocated"
    assert pick_mode({"colocated": 1.0, "separate": 0.95, "hybrid": 0.85}, 0.1) == "hybrid"
    assert pick_mode({"colocated": inf, "separate": 0.95, "hybrid": 0.99}, 0.1) == "separate"
    assert pick_mode({"colocated": 1.0, "separate": 0.95, "hybrid": 0.93}, 0.0) == "hybrid"


@pytest.mark.slow
def test_the_switch_estimate_counts_ending_and_restarting_the_mode(tmp_path: Path) -> None:
    """Before any measured switch, a switch costs ending the running mode (the checkpoint it then
    writes: none when the step's regular one is written) and its start-up from the segment's start
    (process groups, building, loading; here 0.3 s of it before the trainer), plus the new mode's
    slower first step; a measured switch replaces the estimate."""
    model = tiny_model_dir(tmp_path / "model")
    ending = {}
    for every in (2, 3):  # re-checks at steps 3 and 6; checkpoints every 2 or 3 steps
        overrides = fast_overrides(model, tmp_path / f"run{every}", 7)
        cfg = load_config(
            None, [*overrides, f"train.checkpoint_every={every}", "train.eval_at_start_and_end=false"]
        )
        recheck = AutoRecheck(
            COSTS,
            cfg,
            lambda c, cfg=cfg: simulate_modes(c, cfg, 2),  # as if it had a second process
            lambda c, mode, rollout, cfg=cfg: simulate_layout(c, cfg, 2, mode, rollout),
            every=3,
            margin=10.0,  # never switches
        )
        recheck.segment_starting()
        # what run_auto does before the trainer (process groups, freeing memory), as 0.3 s already past
        recheck.segment_started_at -= 0.3
        trainer = Trainer(cfg)
        trainer.recheck = recheck
        trainer.fit()
        assert recheck.startup_s >= 0.3 + trainer.build_s
        assert recheck.switch_cost(None) == pytest.approx(recheck.startup_s + recheck.teardown_s)
        entries = recheck.log
        assert [e["step"] for e in entries] == [3, 6]
        ending[every] = [e["switch_estimate_parts_s"]["ending"] for e in entries]
        assert all(e["switch_estimate_parts_s"]["starting"] >= 0.3 for e in entries)
        assert all(e["switch_cost_s"] >= e["switch_estimate_parts_s"]["starting"] for e in entries)
    # checkpoints every 2: a switch at step 3 would write one (sized by step 2's), at step 6 not
    assert ending[2][0] > 0 and ending[2][1] == 0, "colocated: only the checkpoint, nothing in flight"
    assert ending[3] == [0, 0], "both re-check steps already wrote their checkpoint"
    recheck.measured_switch_s.append(7.0)
    assert recheck.switch_cost(None) == 7.0
