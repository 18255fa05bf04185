"""The execution-mode simulator: closed forms, bounds, the hybrid rule, the seed preset, the CLI."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
from pathlib import Path

import pytest

from omni_diffusion_rl.execution import scheduler
from omni_diffusion_rl.execution.planner.costs import (
    SEED_4XH800_COSTS,
    SEED_4XH800_LENGTHS,
    SEED_4XH800_REPORTED,
    SEED_4XH800_WORKLOADS,
    CostModel,
    Workload,
)
from omni_diffusion_rl.execution.planner.pick import pick_mode
from omni_diffusion_rl.execution.planner.simulate import MODES, simulate, simulate_settings

from .helpers import ENV, REPO, odrl

COSTS = CostModel(
    gen_fixed_s=0.05,
    gen_per_unit_s=0.002,
    length=10,
    train_fixed_s=0.05,
    train_per_sample_s=0.02,
    sync_s=0.01,
)
WORK = Workload(replicas=2, prompts_per_step=4, group_size=4, rollout_replicas=1)


def test_colocated_is_generation_plus_training_per_step() -> None:
    result = simulate("colocated", COSTS, WORK, steps=5)
    step = COSTS.gen(2 * 4) + COSTS.train(2 * 4)
    assert result.seconds == pytest.approx(5 * step)
    assert result.seconds_per_prompt == pytest.approx(step / 4)


@pytest.mark.parametrize("length", [1, 10, 60])
def test_separate_is_bounded_by_its_slower_pool_and_accounts_for_every_sample(length: float) -> None:
    costs = COSTS.with_length(length)
    result = simulate("separate", costs, WORK, steps=30)
    per_group_gen = costs.gen(4)  # one rollout replica, one group per call
    per_step_train = costs.train(16) + costs.sync_s
    lower = max(per_group_gen, per_step_train / 4)  # seconds per prompt group at best
    assert result.seconds_per_prompt >= lower * 0.999
    buf = result.buffer
    assert buf["generated"] == buf["trained"] + sum(buf["dropped"].values()) + buf["waiting"]
    assert buf["trained"] == 30 * 16
    lags = {int(k) for k in buf["staleness_histogram"]}
    assert max(lags) <= WORK.max_staleness, "the wait policy keeps every trained sample within the bound"


def test_hybrid_lends_only_when_it_pays_and_is_never_much_slower_than_separate() -> None:
    for length in (1, 5, 20, 60, 120):
        for switch in (0.0, 0.05, 1.0):
            costs = CostModel(**{**COSTS.__dict__, "length": length, "switch_s": switch})
            sep = simulate("separate", costs, WORK, steps=30).seconds_per_prompt
            hyb = simulate("hybrid", costs, WORK, steps=30)
            assert hyb.seconds_per_prompt <= sep * 1.03, (length, switch)
    never = CostModel(**{**COSTS.__dict__, "length": 60, "switch_s": 100.0})
    assert simulate("hybrid", never, WORK, steps=30).switches == 0, "lending that costs more than the wait"
    long = simulate("hybrid", COSTS.with_length(60), WORK, steps=30)
    assert (
        long.switches > 0
        and long.seconds_per_prompt < simulate("separate", COSTS.with_length(60), WORK, 30).seconds_per_prompt
    )


def test_should_lend_needs_a_low_buffer_and_a_long_enough_wait() -> None:
    rate = scheduler.rollout_rate(COSTS, WORK, 1)  # 1 group per 0.13 s
    p = WORK.prompts_per_step
    step_s = 0.2  # rollout makes 1.5 groups per training step: it cannot keep up with 4
    assert scheduler.should_lend(0, 0, p, 0.4, lent_call_s=0.5, rate=rate, train_step_s=step_s)
    assert not scheduler.should_lend(2, 0, p, 0.4, 0.1, rate, step_s), "buffer above 0.4 of a step"
    assert not scheduler.should_lend(0, 0, p, 0.4, 10.0, rate, step_s), "the lent call outlasts the wait"
    assert not scheduler.should_lend(1, 2, p, 0.4, 0.3, rate, step_s), "groups in flight shorten the wait"
    assert not scheduler.should_lend(0, 0, p, 0.4, 0.1, rate, 1.0), "rollout keeps up with training"
    assert not scheduler.should_lend(0, 0, p, 0.4, 0.1, rate, None), "no training step measured yet"
    assert scheduler.should_lend(0, 0, p, 0.4, 1e9, scheduler.RolloutRate(0.0), step_s), "no rollout"


def test_staleness_gate_follows_the_stream_offset() -> None:
    # p = 4 groups per step, bound 1: with version-0 weights groups 0..7 may be made
    assert scheduler.may_make_group(7, 0, 1, 4) and not scheduler.may_make_group(8, 0, 1, 4)
    # two groups dropped as stale: positions shift back by two
    assert scheduler.may_make_group(9, 0, 1, 4, scheduler.stream_offset(2, 0))
    # three lent groups trained in their place: the stream is trained later
    assert not scheduler.may_make_group(5, 0, 1, 4, scheduler.stream_offset(0, 3))


def test_simulate_reports_the_pick_auto_would_make_by_its_own_rule() -> None:
    for margin in (0.0, 0.1, 0.5):
        row = simulate_settings(COSTS, {"all": WORK}, {"x": 60}, steps=20, margin=margin)["x"]
        steady = {m: row["modes"][m]["steady_seconds_per_prompt"] for m in MODES}
        assert row["auto_picks"] == pick_mode(steady, margin)
    assert row["fastest_steady"] == min(steady, key=steady.get)
    assert simulate_settings(COSTS, {"all": WORK}, {"x": 60}, margin=0.0)["x"]["auto_picks"] == min(
        steady, key=steady.get
    ), "with no margin, the fastest"


def test_regression_pin_of_the_seed_preset_on_the_four_figures_it_was_fitted_to() -> None:
    """A regression pin, not a validation: SEED_4XH800_COSTS is a least-squares fit of these same
    four seed figures with this simulator (see costs.py), so matching them within 2% shows only that
    the simulator still computes what it computed when the preset was fitted. A change to the
    simulator's schedule or cost formulas that moves a figure fails here; re-fit the preset (and say
    why) only for an intended change. No measured timings the preset was not fitted to are recorded
    in the repo (see docs/execution-modes.md): a validation needs `odrl bench modes`'s JSON, which
    holds the costs auto measured next to every mode's real seconds."""
    report = simulate_settings(SEED_4XH800_COSTS, SEED_4XH800_WORKLOADS, SEED_4XH800_LENGTHS)
    short, long = report["short"]["modes"], report["long"]["modes"]
    assert short["colocated"]["seconds_per_prompt"] < short["separate"]["seconds_per_prompt"]
    assert long["separate"]["seconds_per_prompt"] < long["colocated"]["seconds_per_prompt"]
    for setting, figures in SEED_4XH800_REPORTED.items():
        for mode, seconds in figures.items():
            assert report[setting]["modes"][mode]["seconds_per_prompt"] == pytest.approx(seconds, rel=0.02)
    for row in report.values():  # lending never costs more than 3% over separate
        modes = row["modes"]
        assert modes["hybrid"]["seconds_per_prompt"] <= 1.03 * modes["separate"]["seconds_per_prompt"]
    # auto's rule (steady seconds, 10% margin): hybrid is 26% faster at short lengths; at long ones
    # separate is 8.8% faster, inside the margin, so auto stays colocated; with no margin it leaves
    assert (report["short"]["auto_picks"], report["long"]["auto_picks"]) == ("hybrid", "colocated")
    assert report["long"]["fastest_steady"] == "separate"
    no_margin = simulate_settings(SEED_4XH800_COSTS, SEED_4XH800_WORKLOADS, SEED_4XH800_LENGTHS, margin=0.0)
    assert no_margin["long"]["auto_picks"] == "separate"


MEASURED = REPO / "tests" / "fixtures" / "modes_bench_measured.json"
# Where the recording shows the simulator missing the bench's target, with the bound its error stays in
# and why. Short sampling, colocated: predicted 28% under the real seconds in both rounds (-0.279,
# -0.280). Auto, running colocated in the same rounds, was 20% faster than colocated run directly (0.160
# against 0.200 s a prompt; steps of the direct runs took longer both generating and training), and the
# prediction is 12-15% under even auto's: the direct colocated runs are slower than the costs measured
# at warm-up say, by a per-step cost the simulator does not model (not yet found; in the recording of
# 2026-12-01 both were equal). An entry that stops missing fails below: remove it.
KNOWN_MISSES = {("short", "colocated"): 0.35}


def test_the_simulator_predicts_real_timings_it_was_not_fitted_to() -> None:
    """A validation on measurements: `odrl bench modes` recorded on this kind of machine (quiet; see
    the file's `recorded`); each round's auto warm-up measured its unit costs, then each mode ran for
    real. From that round's measured costs alone, the simulator must reproduce the prediction auto
    logged (a change of the simulator moves it: re-record the file, and say why), and land within
    the bench's target (PREDICTION_TARGET, either way) of each mode's real steady seconds in the
    same round, except KNOWN_MISSES. Nothing of these real seconds went into the costs or the
    simulator."""
    from omni_diffusion_rl.benchmarks.common import DEFAULT_CONFIG, QUIET
    from omni_diffusion_rl.benchmarks.modes import PREDICTION_TARGET
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.execution.planner.auto import predict

    recorded = json.loads(MEASURED.read_text())
    assert recorded["rounds"] >= 2 and set(recorded["settings"]) == {"short", "long"}
    errors: dict[tuple[str, str], list[float]] = {}
    for name, row in recorded["settings"].items():
        overrides = [*row["overrides"], *QUIET, f"train.steps={recorded['steps_per_run']}"]
        cfg = load_config(str(REPO / DEFAULT_CONFIG), overrides)
        assert len(row["auto_each_round"]) == recorded["rounds"]
        for i, auto in enumerate(row["auto_each_round"]):
            predicted = predict(CostModel(**auto["measured_costs"]), cfg, recorded["processes"])
            for mode in MODES:
                logged = auto["predicted_s_per_prompt"][mode]
                assert predicted[mode] == pytest.approx(logged, abs=2e-4), (name, i, mode)
                real = row["real_s_per_prompt_each_round"][mode][i]
                errors.setdefault((name, mode), []).append(round(predicted[mode] / real - 1, 3))
    for key, each in errors.items():
        bound = KNOWN_MISSES.get(key, PREDICTION_TARGET)
        assert max(map(abs, each)) <= bound, f"{key}: prediction errors {each}, bound {bound:.0%} ({errors})"
        if key in KNOWN_MISSES:
            assert max(map(abs, each)) > PREDICTION_TARGET, (
                f"{key} meets the target now: drop it from KNOWN_MISSES"
            )


@pytest.mark.slow
def test_simulate_cli_prints_a_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "sim.json"
    done = subprocess.run(
        odrl("simulate", "--output", str(out)), env=ENV, cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "auto picks" in done.stdout and "reported" in done.stdout
    assert set(json.loads(out.read_text())["report"]) == {"short", "long"}
    spec = tmp_path / "costs.json"
    spec.write_text(
        json.dumps({"costs": COSTS.__dict__, "workloads": {"all": WORK.__dict__}, "lengths": {"a": 1}})
    )
    done = subprocess.run(
        odrl("simulate", "--costs", str(spec), "--output", str(out)),
        env=ENV,
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    spec.write_text(json.dumps({"costs": {"gen_fixed_s": 1}}))
    bad = subprocess.run(
        odrl("simulate", "--costs", str(spec)), env=ENV, cwd=REPO, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "Expected JSON with 'costs'" in bad.stderr


@pytest.mark.slow
def test_measured_costs_feed_the_simulator(tmp_path: Path) -> None:
    """Measured costs are what the simulator takes (their sizes are timings: no verdict on them
    beyond being real, since a loaded machine may time 6 sampling steps as fast as 2)."""
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.execution.planner.measure import measure_costs

    from .helpers import fast_overrides, tiny_model_dir

    cfg = load_config(None, fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "run", 1))
    costs = measure_costs(cfg, short_steps=2, long_steps=6, repeats=1, threads=1)
    figures = [costs.gen_fixed_s, costs.gen_per_unit_s, costs.train_fixed_s, costs.train_per_sample_s]
    assert all(math.isfinite(f) and f >= 0 for f in figures) and costs.gen(4) > 0 and costs.sync_s > 0
    assert costs.length == 2 and costs.with_length(6).gen(4) >= costs.with_length(2).gen(4)
    assert not costs.gen_points, "two lengths: the linear fit"
    one = measure_costs(cfg, short_steps=3, long_steps=3, repeats=1, threads=1)
    assert [x for x, _ in one.gen_points] == [2.0, 4.0] == [x for x, _ in one.train_points]
    assert one.gen(2) == one.gen_points[0][1] and one.points_length == 3
    work = Workload(replicas=2, prompts_per_step=2, group_size=2, rollout_replicas=1)
    results = [simulate(mode, costs, work, 5) for mode in MODES]
    assert all(r.trained_prompts == 10 and r.seconds > 0 for r in results)


def test_measured_points_are_interpolated_and_survive_json() -> None:
    from omni_diffusion_rl.execution.planner.measure import costs_to_json

    costs = dataclasses.replace(  # with points, the linear coefficients are not used
        COSTS,
        gen_points=((32, 5.0), (8, 1.0)),  # per sample dearer in the bigger batch: no line fits both
        train_points=((8, 0.5),),
        points_length=10,
    )
    assert costs.gen(8) == 1.0 and costs.gen(32) == 5.0, "the measured points themselves"
    assert costs.gen(16) == pytest.approx(1.0 + 4.0 / 3) and costs.gen(4) == pytest.approx(0.5)
    assert costs.train(16) == pytest.approx(1.0), "one point scales proportionally"
    assert costs.with_length(20).gen(8) == pytest.approx(2.0), "scaled by length"
    assert CostModel(**json.loads(json.dumps(costs_to_json(costs)))) == costs
    with pytest.raises(ValueError, match="points_length"):
        CostModel(0, 0, 1, 0, 0, 0, gen_points=((8, 1.0),))
    with pytest.raises(ValueError, match=">= 0"):
        CostModel(0, 0, 1, 0, 0, 0, gen_points=((8, -1.0),), points_length=1)


def test_auto_predicts_steady_state_and_rules_out_layouts_that_cannot_run() -> None:
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.execution.planner.auto import predict

    cfg = load_config(None, ["data.prompts_per_step=4", "data.group_size=4"])
    predicted = predict(COSTS, cfg, 2)
    steady = simulate("separate", COSTS, Workload(2, 4, 4, rollout_replicas=1), 20)
    assert predicted["separate"] == steady.steady_seconds_per_prompt != steady.seconds_per_prompt
    assert predict(COSTS, cfg, 3)["colocated"] == float("inf"), "4 prompt groups over 3 processes"
