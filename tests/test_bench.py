"""The NFT-step benchmark runs end to end and writes a complete report (no timing assertions)."""

from __future__ import annotations

import inspect
import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.benchmarks.nft_step import ARMS, run_nft_step_bench

pytestmark = pytest.mark.slow  # benchmark runs: left out of `make test-fast`


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread: on a loaded small machine, spinning OpenMP threads make tiny ops ~50x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def paired_verdicts(
    ratios: list[float], at_most: float | None = None, rounding: float = 0.0, two_sided: bool = False
) -> set[str]:
    """The verdicts the benches' rule for a paired comparison (benchmarks/common.py: compare_paired)
    gives for ratios a_i / b_i - 1, each known to +-`rounding` (one verdict when exact). Without
    `at_most`: faster when every round is below 0, slower when every round is above, else within
    noise; with it: met when every round is at most `at_most` (in size, when `two_sided`), missed
    when every round is above."""
    found = set()
    gaps = [abs(r) for r in ratios] if two_sided else ratios
    for low in (min(gaps) - rounding, min(gaps) + rounding):
        for high in (max(gaps) - rounding, max(gaps) + rounding):
            if low > high:
                continue
            if at_most is None:
                found.add("faster" if high < 0 else "slower" if low > 0 else "within noise")
            else:
                found.add("met" if high <= at_most else "missed" if low > at_most else "within noise")
    return found


def test_a_prediction_far_too_low_misses_its_target() -> None:
    """A prediction is held to its target either way: 63% too low is no more "met" than 63% too high."""
    from omni_diffusion_rl.benchmarks.common import compare_paired

    for predicted in (0.37, 1.63):
        compared = compare_paired([predicted] * 2, [1.0, 1.0], at_most=0.15, two_sided=True)
        assert compared["verdict"] == "missed", compared
        assert compared["verdict"] in paired_verdicts(compared["each_round"], 0.15, two_sided=True)
    assert compare_paired([0.9, 1.1], [1.0, 1.0], at_most=0.15, two_sided=True)["verdict"] == "met"


def _check_paired(compared: dict, a: list[float], b: list[float], at_most: float | None = None) -> None:
    """A report's paired comparison against its own per-round figures a and b, each rounded to 4
    digits: its ratios within that rounding, its verdict the rule's for its ratios (kept to 4 digits)."""
    assert len(compared["each_round"]) == len(a) == len(b)
    for ratio, x, y in zip(compared["each_round"], a, b, strict=True):
        bound = 5e-5 * (1 + x / y) / y + 5e-5 + 1e-9  # from x, y and the ratio each rounded to 4 digits
        assert abs(ratio - (x / y - 1)) <= bound, (compared, x, y)
    assert compared.get("at_most") == at_most, compared
    two_sided = compared.get("two_sided", False)
    verdicts = paired_verdicts(compared["each_round"], at_most, rounding=5e-5, two_sided=two_sided)
    assert compared["verdict"] in verdicts, compared
    assert (compared["min"], compared["max"]) == (min(compared["each_round"]), max(compared["each_round"]))


def test_bench_writes_report(tmp_path: Path, one_thread: None) -> None:
    output = tmp_path / "bench" / "nft_step.json"
    result = run_nft_step_bench(output, repeats=1, batch_size=4, timesteps=2)
    assert output.is_file()
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result))
    for key in (
        "machine",
        "config",
        "timings_s_per_step",
        "timings_s_per_sample",
        "median_s_per_sample",
        "min_s_per_sample",
        "ratios",
        "target_ratio_kl_off",
        "meets_target",
    ):
        assert key in report, key
    assert {"torch", "threads", "cpu_count"} <= set(report["machine"])
    assert report["machine"]["threads"] == 1
    assert report["config"] | {"batch_size": 4, "timesteps": 2, "repeats": 1} == report["config"]
    for arm in ARMS:
        assert len(report["timings_s_per_step"][arm]) == 1
        assert all(s > 0 for s in report["timings_s_per_sample"][arm])
        assert report["median_s_per_sample"][arm] > 0
        assert report["min_s_per_sample"][arm] > 0
    for ratio in report["ratios"].values():
        assert ratio > 0 and math.isfinite(ratio)
    assert report["target_ratio_kl_off"] == 1.6
    assert isinstance(report["meets_target"], bool)


def test_reward_server_bench_writes_report(tmp_path: Path, one_thread: None) -> None:
    from omni_diffusion_rl.benchmarks.reward_server import run_reward_server_bench

    output = tmp_path / "reward_server.json"
    result = run_reward_server_bench(  # the attack: one request of each of its 6 kinds (default 200)
        output,
        rounds=1,
        clients=4,
        requests_per_client=2,
        overhead_repeats=2,
        adversarial_requests=6,
        padded_requests=2,
        padding_mb=64,
    )
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result))
    attack = report["adversarial"]
    assert attack["requests"] == 6 and attack["server_alive"] is True, attack
    assert len(attack["kinds"]) == 6 and all(
        sum(k["statuses"].values()) == 1 for k in attack["kinds"].values()
    )
    padded = report["padded"]  # refused from the header: the padding is neither awaited nor received
    assert padded["statuses"] == {"400": 2} and padded["server_alive"] is True, padded
    assert padded["padding_sent_mb"]["max"] < 64, padded
    throughput, overhead = report["throughput"], report["overhead"]
    assert throughput["clients"] == 4 and len(throughput["per_round"]) == 1
    assert throughput["batched_samples_per_s"] > 0 and throughput["batch1_samples_per_s"] > 0
    assert throughput["mean_batch_size"] >= 1
    assert len(overhead["served_ms_each"]) == len(overhead["in_process_ms_each"]) == 2
    assert overhead["added_ms"] == pytest.approx(overhead["served_ms"] - overhead["in_process_ms"], abs=0.02)


def test_an_attack_during_which_no_good_request_finished_is_a_missed_target_not_a_crash() -> None:
    from omni_diffusion_rl.benchmarks.reward_server import _summary, adversarial_lines

    empty = _summary([])
    assert empty == {"count": 0, "median": None, "p90": None, "max": None, "each": []}
    attack = {
        "requests": 6,
        "flood_s": 2.0,
        "good_latency_s": empty,
        "quiet_latency_s": _summary([0.01, 0.03, 0.02]),
        "good_statuses": {},
        "target_good_median_s": 0.5,
        "rss_peak_mb": 300.0,
        "rss_start_mb": 250.0,
        "rss_bound_mb": 1024,
        "kinds": {},
    }
    lines = adversarial_lines(attack, {True: "met", False: "MISSED"})
    assert "no good request finished during the flood (quiet: median 0.020 s; " in lines[1], lines
    assert lines[1].endswith("target median < 0.5 s: MISSED)"), lines


def test_modes_bench_runs_every_mode_and_reports_predictions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from omni_diffusion_rl.benchmarks.modes import AUTO_TARGET, PREDICTION_TARGET, RUN_MODES, run_modes_bench

    from .helpers import fast_overrides, tiny_model_dir

    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "unused", 1)
    output = tmp_path / "bench" / "modes.json"
    settings = {"short": ["sampling.num_steps=2"]}
    result = run_modes_bench(output, None, overrides, steps=2, settings=settings, repeats=1)
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result)) and output.with_suffix(".png").is_file()
    row = report["settings"]["short"]
    assert set(row["real_s_per_prompt"]) == set(RUN_MODES) == {"auto", "colocated", "separate", "hybrid"}
    real = row["real_s_per_prompt"]
    assert all(0 < r["min"] <= r["median"] <= r["max"] for r in real.values())
    assert set(row["predicted_s_per_prompt"]) == {"colocated", "separate", "hybrid"}
    assert all(math.isfinite(v["median"]) for v in row["prediction_error"].values())
    assert row["auto_picked"][0] in row["predicted_s_per_prompt"] and row["auto_warmup_s"][0] > 0
    fixed = ("colocated", "separate", "hybrid")
    fastest = min(real[m]["median"] for m in fixed)  # rounded medians: a tie may go either way
    assert real[row["fastest_fixed_mode"]]["median"] == fastest
    each = row["real_s_per_prompt_each_round"]
    # every verdict recomputed from the report's own per-round figures by the benches' rule
    _check_paired(row["auto_vs_fastest"], each["auto"], each[row["fastest_fixed_mode"]], AUTO_TARGET)
    for a, b in (("separate", "colocated"), ("hybrid", "separate"), ("hybrid", "colocated")):
        _check_paired(row[f"{a}_vs_{b}"], each[a], each[b])
    picked = [i for i, mode in enumerate(row["auto_picked"]) if mode == "colocated"]
    if picked:  # the rounds where auto ran colocated, against colocated's
        by_round = [[each[m][i] for i in picked] for m in ("auto", "colocated")]
        _check_paired(row["auto_running_colocated_vs_colocated"], *by_round)
    else:
        assert row["auto_running_colocated_vs_colocated"] is None
    for mode, predicted in row["predicted_s_per_prompt"].items():
        _check_paired(
            row["prediction_error"][mode], [predicted] * len(each[mode]), each[mode], PREDICTION_TARGET
        )
        assert row["prediction_error"][mode]["two_sided"], "a prediction too low must miss too"
    assert "interleaved rounds" in capsys.readouterr().out


def test_recheck_bench_compares_a_wrong_pick_with_and_without_the_recheck(tmp_path: Path) -> None:
    from omni_diffusion_rl.benchmarks.recheck import run_recheck_bench

    from .helpers import fast_overrides, tiny_model_dir

    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "unused", 1)
    output = tmp_path / "bench" / "recheck.json"
    setting = ["sampling.num_steps=30", "algorithm.timestep_fraction=0.05"]  # generation >> training
    result = run_recheck_bench(output, None, overrides, steps=6, every=2, repeats=1, setting=setting)
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result)) and output.with_suffix(".png").is_file()
    runs = report["runs"]
    assert runs["colocated"]["modes_each_round"] == [["colocated"]] and runs["colocated"]["vs_colocated"] == 0
    stuck = runs["auto, wrong prior, no re-check"]
    assert stuck["modes_each_round"][0] in (["separate"], ["hybrid"]) and stuck["rechecks"] == [0]
    rechecked = runs["auto, wrong prior, re-check"]
    assert (
        rechecked["rechecks"][0] > 0
        and rechecked["modes_each_round"][0][0] == stuck["modes_each_round"][0][0]
    )
    assert all(row["whole_s_per_prompt"] > 0 for row in runs.values())


def test_teacher_bench_compares_schedules_and_replicas(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from omni_diffusion_rl.benchmarks.teacher import REPLICA_LOADS, SCHEDULES, run_teacher_bench
    from omni_diffusion_rl.runtime.threads import thread_share

    from .helpers import fast_overrides, tiny_model_dir

    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), tmp_path / "unused", 1)
    output = tmp_path / "bench" / "teacher.json"
    # the replicas under one load: each load is three more servers running the same code
    result = run_teacher_bench(
        output, None, overrides, steps=3, repeats=1, states=32, replica_loads=("compute-bound",)
    )
    report = json.loads(output.read_text(encoding="utf-8"))
    assert report == json.loads(json.dumps(result))
    schedule = report["schedule"]
    for name in SCHEDULES:
        assert (
            schedule[name]["teacher_s_per_step"]["median"] > 0 and schedule[name]["trained"]["median"] == 12
        )
    for name in ("overlap", "one_step_off"):  # one round: its figure is the median, kept to 4 digits
        per_round = [schedule[n]["s_per_sample"]["median"] for n in (name, "blocking")]
        _check_paired(schedule[f"{name}_vs_blocking_s_per_sample"], [per_round[0]], [per_round[1]])
        assert math.isfinite(schedule[f"hidden_share_of_teacher_time_{name}"]["median"])
    # one step off: steps 2 and 3 (the steady ones) train on rollouts made a step early
    assert (
        schedule["one_step_off"]["staleness"]["median"] == 1
        and schedule["overlap"]["staleness"]["median"] == 0
    )
    served = report["schedule_teacher_server"]  # the same schedules, the teacher a server
    assert served["one_step_off"]["staleness"]["median"] == 1
    for name in SCHEDULES:
        assert served[name]["trained"]["median"] == 12 and served[name]["teacher_s_per_step"]["median"] > 0
    assert math.isfinite(served["hidden_share_of_teacher_time_one_step_off"]["median"])
    assert set(report["replicas"]) == {"compute-bound"}
    assert set(REPLICA_LOADS) == {  # the loads of a default run
        "compute-bound",
        "service 100 ms per batch (remote accelerator stand-in)",
    }
    assert inspect.signature(run_teacher_bench).parameters["replica_loads"].default == tuple(REPLICA_LOADS)
    for row in report["replicas"].values():
        assert row["1 replica states/s"]["median"] > 0 and row["2 replicas states/s"]["median"] > 0
        half = row["1 replica on the share of each of 2 states/s"]["median"]
        assert row["scaling"]["median"] == pytest.approx(
            row["2 replicas states/s"]["median"] / half, rel=1e-3
        )  # one round; spread() rounds to 4 decimals
        # the lone replica computes on the host's cores, each of two on half of them
        assert row["threads"] == {"1 replica": thread_share(1), "2 replicas, each": thread_share(2)}
        assert set(row["client cores"]) == {"1 replica", "2 replicas"}
        assert all(0 < row["client cores"][arm]["median"] for arm in row["client cores"])
    out = capsys.readouterr().out
    assert "teacher time hidden" in out and "teacher server, 100 ms per batch" in out
    assert (
        f"| {thread_share(1)} / {thread_share(2)} |" in out
        and "scaling: 2 against 1 on the same share" in out
    )
    with pytest.raises(ValueError, match="parts must be some of schedules, replicas; got \\['replica'\\]"):
        run_teacher_bench(output, None, overrides, parts=("replica",))
    with pytest.raises(ValueError, match="replica_loads must be some of compute-bound, service 100 ms"):
        run_teacher_bench(output, None, overrides, replica_loads=("gpu",))
