"""separate mode for real: 2 processes under accelerate (1 trainer + 1 rollout) on gloo."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.recheck import wrong_prior
from omni_diffusion_rl.execution.planner.auto import load_costs
from omni_diffusion_rl.execution.planner.measure import costs_to_json
from omni_diffusion_rl.execution.planner.pick import pick_mode
from omni_diffusion_rl.runtime.launch import launcher_command
from omni_diffusion_rl.runtime.subprocesses import run_process_tree

from .helpers import (
    ENV,
    REPO,
    fast_overrides,
    last_json_line,
    odrl_main,
    step_records,
    tiny_model_dir,
    trained_adapter_norm,
)

pytestmark = pytest.mark.slow  # multi-process runs: left out of `make test-fast`


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def _launch(  # noqa: ANN202
    args: list[str],
    port: int,
    env: dict[str, str] | None = None,
    timeout: int = 300,
    processes: int = 2,
    accelerate: bool = False,
):
    """`odrl train ARGS` in `processes` processes on CPU: through the forking launcher of `odrl train
    --nproc` (one import for all of them), or with `accelerate` through `accelerate launch
    recipes/train_nft.py`, as the README runs a recipe (the processes get the same environment)."""
    if accelerate:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_machines", "1"]
        command += ["--num_processes", str(processes), "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += ["--main_process_port", str(port), str(REPO / "recipes" / "train_nft.py"), *args]
    else:
        command = launcher_command(processes, ["train", *args], port)
    env = {**ENV, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", **(env or {})}
    return run_process_tree(command, timeout_s=timeout, env=env, cwd=REPO)


def _ends_by_itself(  # noqa: ANN202
    args: list[str], port: int, env: dict[str, str], timeout: int, processes: int = 2
):
    """A run that must end on its own: past `timeout` (only a hang stop) it is killed and the test
    fails saying it hung."""
    try:
        return _launch(args, port, env=env, timeout=timeout, processes=processes)
    except subprocess.TimeoutExpired as e:
        pytest.fail(
            f"the run was still going after {timeout} s and was killed: it hung. {str(e.stderr)[-3000:]}"
        )


def test_separate_trains_from_the_buffer_and_accounts_for_every_sample(
    model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    proc = _launch(  # through accelerate launch: the modes run under torch's elastic agent too
        [*fast_overrides(model_dir, run, 4), "execution.mode=separate", "execution.data_timeout_s=60"],
        29551,
        accelerate=True,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    ex = summary["execution"]
    buf = ex["buffer"]
    assert buf["trained"] == 4 * 2 * 2 == summary["samples"]["trained"]
    assert buf["generated"] == buf["trained"] + sum(buf["dropped"].values()) + buf["in_training"]
    assert max(int(k) for k in buf["staleness_histogram"]) <= 1, "the staleness bound holds"
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all("buffer/depth" in r for r in rows)
    assert trained_adapter_norm(run) > 0, "the trainer moved the adapter"
    assert (run / "checkpoints" / "latest").exists()


def test_a_dead_rollout_process_stops_the_run_without_hanging(model_dir: Path, tmp_path: Path) -> None:
    """The rollout process ends (exit 17) in its 4th reward call: the run stops by itself (the launch is
    killed only past a hang stop), with no more steps than the 3 groups scored before could make."""
    run = tmp_path / "run"
    args = fast_overrides(model_dir, run, 50) + [
        "execution.mode=separate",
        "execution.data_timeout_s=20",
        "train.eval_at_start_and_end=false",
        "reward.plugins=[tests.plugin_rewards]",
        "reward.weights={test_dies_after: 1.0}",
    ]
    proc = _ends_by_itself(args, 29553, {"ODRL_TEST_DIE_AFTER": "4", "PYTHONPATH": str(REPO)}, 300)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert "exit code 17" in output, output[-3000:]  # named by the launcher
    steps = [r["step"] for r in step_records(run)] if (run / "metrics.jsonl").exists() else []
    assert steps in ([], [1]), f"3 groups were scored (one reward call each), one step's worth: {steps}"


def test_separate_needs_two_processes(
    model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`odrl train` started alone (in this process: the refusal is its exit code and its sentence)."""
    code, _, err = odrl_main(
        capsys, "train", *fast_overrides(model_dir, tmp_path / "run", 1), "execution.mode=separate"
    )
    assert code == 2 and "needs at least 2 processes" in err, err[-3000:]


def test_a_fast_rollout_filling_a_small_buffer_does_not_block_weight_syncs(
    model_dir: Path, tmp_path: Path
) -> None:
    """Rollout faster than training, buffer of one step, drop policy: the trainer's receiver waits for
    room while the rollout process is blocked sending; weight syncs must still get through."""
    args = fast_overrides(model_dir, tmp_path / "run", 4) + [
        "execution.mode=separate",
        "execution.on_stale=drop",
        "execution.buffer_groups=2",
        "execution.sync_timeout_s=20",
        "train.eval_at_start_and_end=false",
    ]
    proc = _launch(args, 29555, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    buf = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buf["trained"] == 16
    assert (
        buf["generated"]
        == buf["trained"] + sum(buf["dropped"].values()) + buf["in_training"] + buf["waiting"]
    )


def _refuse_to_receive(rank: int, init_file: str, result_file: str) -> None:
    import torch.distributed as dist

    from omni_diffusion_rl.execution import transport

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 0:
        try:
            transport.send_bytes(b"x" * 100, 1, None, transport.WEIGHTS_TAG, timeout_s=1.0)
            Path(result_file).write_text("delivered")
        except TimeoutError as e:
            Path(result_file).write_text(f"TimeoutError: {e}")
    else:
        time.sleep(3)  # alive, never receiving
    # no barrier: gloo closes the connection whose send timed out


def test_a_send_nobody_takes_times_out_instead_of_hanging(tmp_path: Path) -> None:
    """Two processes forked from this one (spawned ones would import torch, diffusers and this module
    again, seconds of CPU each, for a test of the transport alone)."""
    import torch.multiprocessing as mp

    result = tmp_path / "result.txt"
    mp.start_processes(
        _refuse_to_receive, args=(str(tmp_path / "init"), str(result)), nprocs=2, start_method="fork"
    )
    assert result.read_text() == "TimeoutError: rank 1 did not take a message within 1 s"


# Scoring takes 1 s a group (test_slow), paid by whoever makes the group: the rollout process, or
# a lent trainer. One rollout process then cannot keep up with training, and hybrid lends. A sleep,
# not computation: a loaded machine slows training, never the sleep, so training must stay well
# under it (a tiny step takes about 0.1 s alone; 0.4 s was too close under load).
SLOW_SCORING = ["reward.plugins=[tests.plugin_rewards]", "reward.weights={color_match: 1.0, test_slow: 1.0}"]
SLOW_SCORING_ENV = {"ODRL_TEST_SLOW_S": "1.0", "PYTHONPATH": str(REPO)}


def _balances(buf: dict) -> bool:
    return buf["generated"] == (
        buf["trained"] + sum(buf["dropped"].values()) + buf["in_training"] + buf["waiting"]
    )


def test_hybrid_lends_the_trainer_when_rollout_cannot_keep_up_and_resumes_with_balanced_accounting(
    model_dir: Path, tmp_path: Path
) -> None:
    """A hybrid run whose rollout process cannot keep up lends the trainer; resumed from its last
    checkpoint for two more steps, its accounting counts both runs and balances, lent group ids and
    the rollout stream continue."""
    run = tmp_path / "run"
    base = fast_overrides(model_dir, run, 6) + SLOW_SCORING
    base += ["execution.mode=hybrid", "train.eval_at_start_and_end=false"]
    proc = _launch(base, 29557, env=SLOW_SCORING_ENV, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ex = last_json_line(proc.stdout)["execution"]
    assert ex["mode"] == "hybrid" and _balances(ex["buffer"]) and ex["buffer"]["trained"] == 6 * 2 * 2
    hybrid = ex["hybrid"]
    assert hybrid["lends"] > 0 and hybrid["switches"] == 2 * hybrid["lends"]
    assert hybrid["lent_groups"] == hybrid["lends"], "one trainer process: one group per lend"
    assert 0 < hybrid["lent_groups_trained"] <= hybrid["lent_groups"]
    first = hybrid["lends_logged"][0]
    assert first["lent_s"] > 0 and first["switch_s"] >= 0 and first["buffer_groups"] < 2
    assert max(int(k) for k in ex["buffer"]["staleness_histogram"]) <= 1
    assert set(ex["idle_fraction"]["rollout"]) == {"staleness_gate", "buffer_full", "weight_sync"}
    assert set(ex["idle_fraction"]["trainer"]) == {"waiting_for_data", "weight_sync", "switching"}

    lent_before = hybrid["lent_groups"]
    streamed = json.loads((run / "checkpoints" / "step_0000006" / "state.json").read_text())["execution"]
    resume = ["train.steps=8", "--resume", str(run / "checkpoints")]
    resumed = _launch([*base, *resume], 29561, env=SLOW_SCORING_ENV, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    summary = last_json_line(resumed.stdout)
    buf = summary["execution"]["buffer"]
    assert _balances(buf), buf
    assert buf["trained"] == 8 * 2 * 2 == summary["samples"]["trained"], "both runs' samples are counted"
    state = json.loads((run / "checkpoints" / "step_0000008" / "state.json").read_text())["execution"]
    assert state["lent_made"] == lent_before + summary["execution"]["hybrid"]["lent_groups"], (
        "lent ids continue"
    )
    assert state["stream_next"] > streamed["stream_next"], "the rollout stream continues past the first run's"
    assert [r["step"] for r in step_records(run)] == list(range(1, 9))


def test_auto_measures_predicts_and_runs_the_fastest_mode(model_dir: Path, tmp_path: Path) -> None:
    args = fast_overrides(model_dir, tmp_path / "run", 2)
    args += ["execution.mode=auto", "train.eval_at_start_and_end=false"]
    proc = _launch(args, 29563, timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    auto = summary["auto"]
    predicted = auto["predicted_s_per_prompt"]
    assert set(predicted) == {"colocated", "separate", "hybrid"} and all(v > 0 for v in predicted.values())
    # colocated unless clearly slower; the report rounds to 4 digits, so a near-tie (between modes, or
    # at the margin) may go either way
    near = {m for m in predicted if predicted[m] <= min(predicted.values()) + 2e-4}
    rounded_away = {pick_mode(predicted, margin) for margin in (0.0995, 0.1, 0.1005)}
    assert auto["picked"] in rounded_away or (auto["picked"] in near and len(near) > 1), predicted
    measured = auto[
        "measured_costs"
    ]  # at one length the measured points are kept (the fitted slope may be 0)
    assert auto["warmup_s"] > 0 and len(measured["gen_points"]) >= 2
    assert all(seconds > 0 for _, seconds in measured["gen_points"] + measured["train_points"])
    if auto["picked"] != "colocated":
        assert summary["execution"]["mode"] == auto["picked"]
    assert summary["samples"]["trained"] == 2 * 2 * 2


# The re-checks below must switch, and clearly: the wrong prior's misprediction must save several
# times what a switch costs (seconds: the group in flight, the start of a mode, wandb's included,
# and an async mode's first step). The rollout is made slow the way SLOW_SCORING does it, by a sleep
# in the reward, not by computation (hundreds of sampling steps took a minute of CPU a run): a group
# then takes SLOW_GROUP_S whatever the machine's load, and training a step (about 0.1 s alone) stays
# far under it. Measured: with 2 trainers, 2 s a group and 16 steps save 28 s against a 4.6 s switch;
# one trainer saves less per prompt (it halves a step, not a third of it) and its switch costs two
# groups and wandb's start (13 s), so 3 s a group and 16 steps save about 42 s.
SLOW_GROUP_S = {"follow": "2.0", "recheck": "3.0"}
FAST_SAMPLING_STEPS = 3  # fast_overrides' sampling.num_steps: the prior's length


def _wrong_prior(path: Path, length: int = FAST_SAMPLING_STEPS) -> Path:
    """Costs under which separate (1 rollout process) looks twice as fast as colocated."""
    path.write_text(json.dumps(wrong_prior(2, 2, length)))
    return path


def _flat_prior(path: Path) -> Path:
    """Generation nearly free and training all fixed cost: every async split looks the same, and
    auto starts with the first (1 rollout process)."""
    costs = {
        "gen_fixed_s": 0.001,
        "gen_per_unit_s": 0.0,
        "length": FAST_SAMPLING_STEPS,
        "train_fixed_s": 10.0,
    }
    path.write_text(json.dumps({"costs": {**costs, "train_per_sample_s": 0.0, "sync_s": 0.0}}))
    return path


def _check_segments(summary: dict, steps: int) -> list[dict]:
    """Every switch made by a re-check, one segment per mode run, every step once, nothing lost."""
    auto = summary["auto"]
    switched = [r for r in auto["rechecks"] if r["next"] != r["running"]]
    segments = auto["segments"]
    assert [s["mode"] for s in segments[1:]] == [r["next"].split()[0] for r in switched]
    assert [s["to_step"] for s in segments[:-1]] == [s["from_step"] for s in segments[1:]]
    assert [s["to_step"] for s in segments[:-1]] == [r["step"] for r in switched]
    assert segments[0]["from_step"] == 0 and segments[-1]["to_step"] == steps
    assert auto["switches"] == len(switched) and all(r["measured_switch_s"] > 0 for r in switched)
    assert all(_balances(s["buffer"]) for s in segments if s["mode"] != "colocated")
    assert summary["samples"]["trained"] == steps * 2 * 2, "every mode's trained samples are counted"
    return switched


def test_auto_rechecks_with_the_runs_timings_and_switches_modes(model_dir: Path, tmp_path: Path) -> None:
    """A wrong prior (generation nearly free, training all fixed cost) makes auto start separate;
    the re-check calibrates it with the rollout's real timings and switches (to colocated, or to
    hybrid, which the simulator then predicts about as fast) from a checkpoint, losing nothing."""
    prior, steps = _wrong_prior(tmp_path / "prior.json"), 16
    run = tmp_path / "run"
    args = [
        *fast_overrides(model_dir, run, steps),
        *SLOW_SCORING,
        "execution.mode=auto",
        "tracking.wandb=true",
    ]
    args += [
        f"execution.auto_costs={prior}",
        "execution.auto_recheck_every=2",
        "execution.auto_switch_margin=0.3",
    ]
    env = {**SLOW_SCORING_ENV, "ODRL_TEST_SLOW_S": SLOW_GROUP_S["recheck"]}
    proc = _launch(args, 29565, env=env, timeout=420)  # 1-2 minutes, sleeping mostly
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    auto = summary["auto"]
    assert auto["picked"] == "separate" and auto["costs_from"] == str(prior)
    # started from the prior as given, not from a warm-up's measurements
    given = load_costs(str(prior)).with_length(FAST_SAMPLING_STEPS)
    assert auto["measured_costs"] == costs_to_json(given), auto
    switched = _check_segments(summary, steps)
    why = [(r["why"], r["switch_cost_s"]) for r in auto["rechecks"]]
    assert switched and switched[0]["running"] == "separate (1 rollout)", why
    assert switched[0]["measured"]["gen_s"] > 0.001, "calibrated with the rollout's real timings"
    assert [r["step"] for r in step_records(run)] == list(range(1, steps + 1))
    assert "heldout_reward_after" in summary, "evaluated once, at the real end"
    assert json.loads((run / "summary.json").read_text())["auto"]["switches"] == len(switched)
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == len(auto["segments"]) and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1, (
        "one wandb run, continued"
    )


def test_two_trainer_processes_share_each_step(model_dir: Path, tmp_path: Path) -> None:
    """3 processes, 1 rollout: the leader takes each step from the buffer and sends the second
    trainer its half; both train (one gradient average); the leader syncs; both are lent."""
    run = tmp_path / "run"
    args = fast_overrides(model_dir, run, 4) + ["execution.mode=hybrid", "execution.rollout_replicas=1"]
    proc = _launch([*args, *SLOW_SCORING], 29567, env=SLOW_SCORING_ENV, timeout=240, processes=3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    ex = summary["execution"]
    assert (ex["trainer_replicas"], ex["rollout_replicas"]) == (2, 1)
    hybrid = ex["hybrid"]
    assert hybrid["lends"] > 0, "one rollout process of 30 sampling steps cannot keep up with training"
    assert hybrid["lent_groups"] == 2 * hybrid["lends"], "each lend makes a group on both trainer processes"
    assert hybrid["lent_groups_trained"] <= hybrid["lent_groups"]  # the last ones may end the run waiting
    assert _balances(ex["buffer"]) and ex["buffer"]["trained"] == 4 * 2 * 2 == summary["samples"]["trained"]
    assert max(int(k) for k in ex["buffer"]["staleness_histogram"]) <= 1
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4], "one metrics writer"
    assert trained_adapter_norm(run) > 0, "the trainers moved the adapter"
    assert not list(run.glob("failed_samples.rank*")), "no sample failed on either trainer"


def test_a_layout_without_whole_shares_is_refused(model_dir: Path, tmp_path: Path) -> None:
    args = fast_overrides(model_dir, tmp_path / "run", 1) + [
        "execution.mode=separate",
        "data.prompts_per_step=3",
    ]
    proc = _launch([*args, "execution.rollout_replicas=1"], 29569, timeout=120, processes=3)
    assert proc.returncode != 0 and "divisible by the 2 trainer processes" in proc.stderr


def test_auto_follows_the_leader_with_two_trainer_processes(model_dir: Path, tmp_path: Path) -> None:
    """3 processes: colocated cannot split 2 prompt groups, so auto weighs separate and hybrid at
    each split; the wrong prior starts separate with 2 trainers, and when the leader's re-check
    switches, the other trainer process follows at the same step."""
    run, steps = tmp_path / "run", 16
    args = fast_overrides(model_dir, run, steps) + SLOW_SCORING + ["execution.mode=auto"]
    args += [
        f"execution.auto_costs={_flat_prior(tmp_path / 'prior.json')}",
        "execution.auto_recheck_every=2",
    ]
    env = {**SLOW_SCORING_ENV, "ODRL_TEST_SLOW_S": SLOW_GROUP_S["follow"]}
    proc = _launch([*args, "train.eval_at_start_and_end=false"], 29571, env=env, timeout=420, processes=3)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    auto = summary["auto"]
    assert auto["predicted_s_per_prompt"]["colocated"] == float("inf")
    assert auto["picked"] == "separate" and auto["rollout_replicas"]["separate"] == 1
    switched = _check_segments(summary, steps)
    assert switched and switched[0]["running"] == "separate (1 rollout)", [r["why"] for r in auto["rechecks"]]
    assert auto["segments"][0]["trainer_replicas"] == 2
    assert [r["step"] for r in step_records(run)] == list(range(1, steps + 1))


def _fails_by_itself(args: list[str], weights: str, env: dict[str, str], port: int, hang_s: int):  # noqa: ANN202
    """A 3-process run with the test plug-in rewards `weights`: it must fail on its own (killed after
    `hang_s`, it hung)."""
    args = [*args, "reward.plugins=[tests.plugin_rewards]", f"reward.weights={weights}"]
    proc = _ends_by_itself(args, port, {**env, "PYTHONPATH": str(REPO)}, hang_s, processes=3)
    assert proc.returncode != 0, proc.stderr[-3000:]
    return proc


def test_a_failed_step_on_the_leader_stops_every_trainer_process(model_dir: Path, tmp_path: Path) -> None:
    """2 trainers: the leader's step times out waiting for data; the other trainer, waiting for its
    share, is told and fails with it instead of waiting in the gradient collective."""
    args = fast_overrides(model_dir, tmp_path / "run", 4) + ["execution.mode=separate"]
    args += ["execution.data_timeout_s=1", "train.eval_at_start_and_end=false"]
    proc = _fails_by_itself(args, "{test_slow: 1.0}", {"ODRL_TEST_SLOW_S": "3"}, 29573, 300)  # 3 s a group
    assert "no full step of rollout data for 1 s" in proc.stderr, proc.stderr[-6000:]
    assert "the trainer leader (rank 0) failed at step 1" in proc.stderr


def test_a_trainer_process_failing_its_lent_group_stops_every_process(
    model_dir: Path, tmp_path: Path
) -> None:
    """hybrid, 2 trainers: the second trainer's reward raises while it makes a lent group; it tells
    the leader, which collects the answers, stops the rollout process and fails with it (before the
    fix the leader waited for that group without a limit while the other waited in a collective)."""
    args = fast_overrides(model_dir, tmp_path / "run", 6)
    args += ["execution.mode=hybrid", "execution.rollout_replicas=1", "train.eval_at_start_and_end=false"]
    weights = "{color_match: 1.0, test_slow: 1.0, test_error_on_rank: 1.0}"  # rollout cannot keep up
    env = {"ODRL_TEST_ERROR_RANK": "1", "ODRL_TEST_SLOW_S": "0.5"}
    proc = _fails_by_itself(args, weights, env, 29575, 300)
    assert "trainer process 1 failed making lent group" in proc.stderr
    assert "test_error_on_rank: refused on rank 1" in proc.stderr
