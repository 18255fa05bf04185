"""The execution-mode simulator: closed forms, bounds, the hybrid rule, the seed preset, the CLI."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from omni_diffusion_rl.execution import scheduler
from omni_diffusion_rl.execution.costs import (
    SEED_4XH800_COSTS,
    SEED_4XH800_LENGTHS,
    SEED_4XH800_REPORTED,
    SEED_4XH800_WORKLOADS,
    CostModel,
    Workload,
)
from omni_diffusion_rl.execution.simulate import best_mode, simulate, simulate_settings

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
    rate = scheduler.rollout_rate(COSTS, WORK, 1)
    assert scheduler.should_lend(0, 0, COSTS, WORK, rate)
    assert not scheduler.should_lend(2, 0, COSTS, WORK, rate), "buffer above 0.4 of a step"
    slow_switch = CostModel(**{**COSTS.__dict__, "switch_s": 10.0})
    assert not scheduler.should_lend(0, 0, slow_switch, WORK, rate)


def test_auto_picks_the_fastest_predicted_mode() -> None:
    mode, results = best_mode(COSTS.with_length(60), WORK)
    assert results[mode].seconds_per_prompt == min(r.seconds_per_prompt for r in results.values())


def test_seed_preset_reproduces_the_seeds_direction_and_figures() -> None:
    report = simulate_settings(SEED_4XH800_COSTS, SEED_4XH800_WORKLOADS, SEED_4XH800_LENGTHS)
    short, long = report["short"]["modes"], report["long"]["modes"]
    assert short["colocated"]["seconds_per_prompt"] < short["separate"]["seconds_per_prompt"]
    assert long["separate"]["seconds_per_prompt"] < long["colocated"]["seconds_per_prompt"]
    for setting, figures in SEED_4XH800_REPORTED.items():
        for mode, seconds in figures.items():
            assert report[setting]["modes"][mode]["seconds_per_prompt"] == pytest.approx(seconds, rel=0.02)
    assert report["short"]["auto_picks"] == "colocated" and report["long"]["auto_picks"] != "colocated"


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


def test_measured_costs_grow_with_length_and_feed_the_simulator(tmp_path: Path) -> None:
    from omni_diffusion_rl.config import load_config
    from omni_diffusion_rl.execution.measure import measure_costs

    from .helpers import fast_overrides, tiny_model_dir

    cfg = load_config(None, fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "run", 1))
    costs = measure_costs(cfg, short_steps=2, long_steps=6, repeats=1, threads=1)
    assert costs.gen(4) > 0 and costs.train(4) > 0 and costs.sync_s > 0
    assert costs.with_length(6).gen(4) > costs.with_length(2).gen(4)
    work = Workload(replicas=2, prompts_per_step=2, group_size=2, rollout_replicas=1)
    mode, results = best_mode(costs, work, steps=5)
    assert mode in results and all(r.trained_prompts == 10 for r in results.values())
