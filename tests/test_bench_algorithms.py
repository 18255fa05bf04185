"""`odrl bench algorithms`: the race's arithmetic on given curves, and a short real race."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.algorithms import (
    CONTESTANTS,
    contestant,
    first_reach,
    format_table,
    headline,
    overlaps,
    race_result,
    run_algorithms_bench,
    run_name,
    summarise,
    thread_budget,
)

from .helpers import REPO, fast_overrides, tiny_model_dir


def _curve(points: list[tuple[float, float]]) -> list[dict[str, float]]:
    return [
        {
            "step": 10 * i,
            "seconds": s,
            "samples": 64.0 * 10 * i,
            "accuracy": a,
            "flooded": 0.0,
            "recognisable_shape": 0.9,
            "diversity": 0.2,
        }
        for i, (s, a) in enumerate(points)
    ]


def test_time_to_a_threshold_is_the_first_evaluation_at_or_above_it() -> None:
    curve = _curve([(0, 0.15), (10, 0.6), (20, 0.4), (30, 0.95)])
    assert first_reach(curve, 0.5)["seconds"] == 10  # type: ignore[index]
    assert first_reach(curve, 0.9)["samples"] == 64.0 * 30  # type: ignore[index]
    assert first_reach(curve, 0.99) is None


@pytest.mark.slow
def test_the_summary_counts_seeds_that_never_reach_and_bounds_the_headline() -> None:
    fast = [_curve([(0, 0.15), (10, 0.95)]), _curve([(0, 0.15), (20, 0.92)])]
    slow = [_curve([(0, 0.15), (100, 0.95)]), _curve([(0, 0.15), (120, 0.3)])]
    per = {"nft": summarise(fast, (0.5, 0.9)), "flow_grpo": summarise(slow, (0.5, 0.9))}
    assert per["nft"]["to_0.9"]["seconds"] == {"median": 15.0, "min": 10.0, "max": 20.0}
    assert per["flow_grpo"]["to_0.9"]["reached"] == 1
    # flow_grpo's median counts the seed that never got there at its whole time (120): a lower bound
    assert headline(per, 0.9) == {
        "ratio": 7.33,
        "kind": "at least",
        "reached": {"nft": 2, "flow_grpo": 1, "seeds": 2},
    }
    both = {"nft": per["nft"], "flow_grpo": summarise([slow[0], slow[0]], (0.5, 0.9))}
    assert headline(both, 0.9) == {
        "ratio": 6.67,
        "kind": "exact",
        "reached": {"nft": 2, "flow_grpo": 2, "seeds": 2},
        "range": [5.0, 10.0],
    }
    swapped = {"nft": per["flow_grpo"], "flow_grpo": per["nft"]}
    assert headline(swapped, 0.9)["kind"] == "at most"
    already = {"nft": summarise([_curve([(0, 0.95)])], (0.9,)), "flow_grpo": per["flow_grpo"]}
    assert headline(already, 0.9)["kind"] == "unknown"  # no division by a zero time
    result = race_result({"nft": fast, "flow_grpo": slow}, (0.5, 0.9))
    assert result["headline"]["0.9"]["kind"] == "at least"
    assert result["within_seed_spread_of_nft"]["0.9"]["flow_grpo"]["seconds_to_0.9"] is False
    table = format_table(result)
    assert "(1/2 seeds)" in table and "time to 0.9 over DiffusionNFT's: at least 7.33x" in table
    assert overlaps({"min": 0, "max": 1, "median": 0.5}, {"min": 1, "max": 2, "median": 1.5}) is True
    assert overlaps({"min": 0, "max": 0.9, "median": 0.5}, {"min": 1, "max": 2, "median": 1.5}) is False


def test_a_variant_is_its_base_with_overrides_checked_before_any_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    variant = contestant("raft@optim.lr=3e-3@algorithm.raft_keep=2")
    assert variant.config == CONTESTANTS["raft"].config
    assert variant.overrides == (*CONTESTANTS["raft"].overrides, "optim.lr=3e-3", "algorithm.raft_keep=2")
    assert "with optim.lr=3e-3" in variant.about
    assert contestant("nft") is CONTESTANTS["nft"]
    assert (
        run_name("nft@algorithm.adv_per_reward=true@a.b=[1, 2]")
        == "nft_algorithm.adv_per_reward=true_a.b=_1_2_"
    )
    with pytest.raises(ValueError, match="unknown contestant 'nfx'; choose from nft"):
        contestant("nfx@optim.lr=1")
    with pytest.raises(ValueError, match=r"\['lr3'\] must be section.key=value"):
        contestant("nft@lr3")
    with pytest.raises(ValueError, match="contestant 'nft@optim.lr=-1'.*optim.lr"):
        contestant("nft@optim.lr=-1")
    with pytest.raises(ValueError, match="contestant 'nft@algorithm.no_such=1'.*no_such"):
        run_algorithms_bench(Path("unused.json"), [], ("nft", "nft@algorithm.no_such=1"), seeds=(0,))


def test_contestants_split_at_commas_outside_brackets(monkeypatch: pytest.MonkeyPatch) -> None:
    """A variant's list or mapping value keeps its commas; distillation races its own recipe."""
    import argparse

    from omni_diffusion_rl.cli.arguments import _names

    monkeypatch.chdir(REPO)
    targets = "nft@model.lora_targets=[to_q,to_k,modulation]@reward.weights={color_match: 1, av_sync: 2}"
    assert _names(f"nft, distill,{targets}") == ("nft", "distill", targets)
    assert contestant(targets).overrides == (
        "model.lora_targets=[to_q,to_k,modulation]",
        "reward.weights={color_match: 1, av_sync: 2}",
    )
    assert _names("nft@a.b=[1,2]],raft") == ("nft@a.b=[1,2]]", "raft")  # a stray bracket closes nothing
    with pytest.raises(argparse.ArgumentTypeError, match="comma-separated"):
        _names(" , ")
    assert contestant("distill").config == "recipes/configs/tiny_t2av_distill.yaml"


@pytest.mark.slow
def test_a_failed_run_kills_the_runs_in_progress_and_twins_are_refused() -> None:
    import subprocess
    import sys
    import threading

    from omni_diffusion_rl.benchmarks.algorithms import _in_parallel
    from omni_diffusion_rl.runtime.subprocesses import run_process_tree

    procs: list[subprocess.Popen[str]] = []
    running = threading.Event()
    outcome: dict[str, int] = {}

    def train(seed: int, name: str) -> list[dict[str, float]]:
        if seed == 0:
            assert running.wait(timeout=60)
            raise RuntimeError("race run failed")
        sleeper = [sys.executable, "-c", "import time; time.sleep(600)"]
        done = run_process_tree(sleeper, 900, started=lambda p: (procs.append(p), running.set()))
        outcome["returncode"] = done.returncode
        return []

    with pytest.raises(RuntimeError, match="race run failed"):
        _in_parallel(train, [(0, "nft"), (1, "nft")], 2, procs)
    assert outcome["returncode"] == -9  # killed, not waited for
    with pytest.raises(ValueError, match=r"named twice .*\['nft'\]"):
        run_algorithms_bench(Path("unused.json"), [], ("nft", "flow_grpo", "nft"), seeds=(0,))


def test_a_variants_own_overrides_win_over_the_races(monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_diffusion_rl.benchmarks.algorithms import train_command

    args = train_command(CONTESTANTS["raft"], Path("run"), 0, 2, 1, ["optim.lr=1e-2"])
    assert args.index("optim.lr=1e-2") < args.index("optim.lr=3e-4")  # the later one is what loads
    monkeypatch.chdir(REPO)
    from omni_diffusion_rl.config import load_config

    assert load_config(args[args.index("train") + 1], args[args.index("train") + 2 :]).optim.lr == 3e-4
    monkeypatch.setenv("OMP_NUM_THREADS", "two")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='two' is not a positive whole number"):
        thread_budget(2)


def test_each_concurrent_run_gets_an_equal_share_of_the_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert [thread_budget(j) for j in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert thread_budget(1) == (os.cpu_count() or 1)
    with pytest.raises(ValueError, match="jobs must be at least 1"):
        run_algorithms_bench(Path("unused.json"), [], ("nft",), seeds=(0,), jobs=0)


@pytest.mark.slow
def test_a_short_race_writes_curves_a_table_and_a_plot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(REPO)  # the contestants' recipes are named from the repository root
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    model = tiny_model_dir(tmp_path / "model")
    overrides = [o for o in fast_overrides(model, tmp_path / "unused", 2) if not o.startswith("train.")]
    output = tmp_path / "bench" / "algorithms.json"
    result = run_algorithms_bench(
        output, overrides, ("nft", "flow_grpo"), seeds=(0,), steps=2, eval_every=1, jobs=2
    )
    saved = json.loads(output.read_text())
    assert saved["per_contestant"].keys() == {"nft", "flow_grpo"} == result["curves"].keys()
    assert saved["jobs"] == 2 and saved["threads_per_run"] == 1  # OMP_NUM_THREADS=1 shared by 2 jobs
    assert "2 run(s) at a time, 1 thread(s) each" in format_table(saved)
    for curve in saved["curves"].values():
        assert [p["step"] for p in curve[0]] == [0, 1, 2]  # the start, every step, the end
        assert [p["samples"] for p in curve[0]] == [0, 4, 8] and curve[0][-1]["seconds"] > 0
    assert output.with_suffix(".png").stat().st_size > 0


@pytest.mark.parametrize("name", sorted(CONTESTANTS))
def test_every_contestants_config_loads_with_its_overrides(name: str) -> None:
    from omni_diffusion_rl.config import load_config

    entry = CONTESTANTS[name]
    cfg = load_config(entry.config, list(entry.overrides))
    if name == "flow_grpo_fast":  # flow_grpo's fast configs: 3 SDE steps drawn in the first half, no KL
        a = cfg.algorithm
        assert (a.sde_window_size, a.sde_window_range, a.kl_coef, a.per_group_std) == (3, 5, 0.0, False)
        assert cfg.sampling.num_steps // 2 == a.sde_window_range
