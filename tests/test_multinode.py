"""Training spread over several machines: each machine is played by one launch on loopback (127.0.0.1).

`odrl train --nnodes 2 --node-rank R --master-port P` on each (or `accelerate launch --num_machines 2
--machine_rank R ...` as accelerate users start it): the same run as one machine with as many
processes; machines that disagree (process counts, configs) are refused before any step; a machine
that never joins, or a process that dies before the run begins, ends the others with a sentence.

Where machine 0's `odrl train` need not be a process of its own (its launcher's exit code and output
are what is checked), this test process runs it (`odrl_here`): its launched processes are real ones.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from omni_diffusion_rl.runtime.launch import Machines, accelerate_command, free_port, launcher_command
from omni_diffusion_rl.runtime.launch_check import (
    LaunchError,
    ProcessLayout,
    config_problem,
    describe_process,
    flatten,
    layout_problem,
    wait_for_every_process,
)
from omni_diffusion_rl.runtime.machine_zero import torchrun_arguments
from omni_diffusion_rl.runtime.subprocesses import run_process_tree

from . import listening
from .helpers import ENV, REPO, fast_overrides, last_json_line, odrl, step_records, tiny_model_dir

# the launchers run by this process; every machine holds the run's secret, so the runs below prove it
HERE_ENV = {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1", "ODRL_RUN_SECRET": "the-tests-run-secret"}
LAUNCH_ENV = {**ENV, **HERE_ENV}
SAFETY_TIMEOUT_S = 300  # a hang fails the test; no verdict depends on how fast a run is
CLOCK_KEYS = ("time/", "idle/", "rollout/seconds_per_group", "buffer/depth")  # as test_behaviour_fixture
# separate mode with a deterministic schedule (see test_behaviour_fixture): the rollout process
# generates each step's groups with the trainer's latest weights only, whatever the timing
DETERMINISTIC_SEPARATE = [
    "execution.mode=separate",
    "execution.rollout_replicas=1",
    "execution.max_staleness=0",
    "execution.on_stale=wait",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


OFFLINE = {k: ENV[k] for k in ("HF_HUB_OFFLINE", "WANDB_MODE", "PYTHONUNBUFFERED")}  # what ENV adds
HANG_S = 600  # a run that takes longer hangs: its processes are stopped (never a verdict on speed)


@contextlib.contextmanager
def _environment(values: dict[str, str], cwd: Path) -> Iterator[None]:
    """os.environ with `values` set and `cwd` the working folder, as they were after."""
    before, folder = {key: os.environ.get(key) for key in values}, Path.cwd()
    os.environ.update(values)
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(folder)
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _output_to(folder: Path) -> Iterator[tuple[Path, Path]]:
    """This process's stdout and stderr (file descriptors 1 and 2, which launched processes inherit,
    and sys.stdout/sys.stderr) appended to folder/stdout and folder/stderr meanwhile."""
    paths = (folder / "stdout", folder / "stderr")
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(paths[0], "a") as out, open(paths[1], "a") as err:
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                yield paths
        finally:
            out.flush()
            err.flush()
            for fd, kept in zip((1, 2), saved, strict=True):
                os.dup2(kept, fd)
                os.close(kept)


def stop_launched() -> None:
    """SIGKILL the sessions this process started (its children that lead a session of their own: a
    launcher and the processes it started)."""
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            _state, parent, _group, session = (entry / "stat").read_text().rsplit(")", 1)[1].split()[:4]
        except (OSError, ValueError):  # ended meanwhile
            continue
        if int(parent) == me and int(session) == int(entry.name):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(entry.name), signal.SIGKILL)


def odrl_here(
    args: list[str], env: dict[str, str], timeout_s: float = HANG_S
) -> subprocess.CompletedProcess[str]:
    """`odrl ARGS` as its own process would run it, in this one (`main`: a run of one process trains
    here; `--nproc N` or `--nnodes M` launches its processes from here, as the command's launcher):
    the exit code and everything printed, by this process and by the ones it launched. The
    environment is this one's, offline, with `env`; the working folder the repository's.
    accelerate's state is reset before and after, so that nothing carries over between runs or into
    other tests. Past `timeout_s` (or when interrupted) every process launched is killed."""
    from accelerate.state import AcceleratorState

    from omni_diffusion_rl.cli import main

    watchdog = threading.Timer(timeout_s, stop_launched)
    watchdog.daemon = True
    with tempfile.TemporaryDirectory(prefix="odrl-here-") as folder:
        AcceleratorState._reset_state(reset_partial_state=True)
        watchdog.start()
        try:
            with _environment({**OFFLINE, **env}, REPO), _output_to(Path(folder)) as (out, err):
                code = main(args)
        except BaseException:
            stop_launched()
            raise
        finally:
            watchdog.cancel()
            AcceleratorState._reset_state(reset_partial_state=True)
        return subprocess.CompletedProcess(["odrl", *args], code, out.read_text(), err.read_text())


def _machine_args(
    rank: int, port: int, args: list[str], nproc: int = 1, join_timeout_s: int = 120
) -> list[str]:
    """One machine's `odrl train` arguments of a 2-machine run."""
    machine = ["--nnodes", "2", "--node-rank", str(rank), "--master-port", str(port)]
    return ["train", "--nproc", str(nproc), *machine, "--join-timeout", str(join_timeout_s), *args]


def _machine(rank: int, port: int, args: list[str], nproc: int = 1, join_timeout_s: int = 120) -> list[str]:
    """One machine's `odrl train` command of a 2-machine run."""
    return odrl(*_machine_args(rank, port, args, nproc, join_timeout_s))


def _accelerate_machine(rank: int, port: int, args: list[str]) -> list[str]:
    """The same machine started with accelerate launch and the recipe (1 process per machine)."""
    command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    command += ["--num_machines", "2", "--machine_rank", str(rank), "--main_process_ip", "127.0.0.1"]
    command += ["--main_process_port", str(port), "--rdzv_conf", "timeout=120"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no"]
    return [*command, str(REPO / "recipes" / "train_nft.py"), *args]


def _run_machines(machine_0: list[str], *others: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """Every machine started at once, run to its end: machine 0's `odrl train` (its arguments) by this
    process, as its launcher; the others' commands each in a process and session of its own."""
    with ThreadPoolExecutor(len(others)) as pool:
        runs = [pool.submit(run_process_tree, c, SAFETY_TIMEOUT_S, LAUNCH_ENV, REPO) for c in others]
        first = odrl_here(machine_0, HERE_ENV, SAFETY_TIMEOUT_S)
        return [first, *(run.result() for run in runs)]


def _one_machine(nproc: int, args: list[str]) -> subprocess.CompletedProcess[str]:
    """`odrl train --nproc N` of one machine, its launcher run by this process."""
    done = odrl_here(["train", "--nproc", str(nproc), *args], HERE_ENV, SAFETY_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-4000:]
    return done


def _clock_free(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(CLOCK_KEYS)} for r in step_records(run_dir)]


def _assert_same_adapters(a: Path, b: Path) -> None:
    """The latest checkpoint's adapter tensors of two runs, bit for bit."""
    from safetensors.torch import load_file

    def tensors(run: Path) -> dict:
        return load_file(
            run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip() / "tensors.safetensors"
        )

    adapters_a, adapters_b = tensors(a), tensors(b)
    assert adapters_a.keys() == adapters_b.keys() and adapters_a
    assert [k for k in adapters_a if not adapters_a[k].equal(adapters_b[k])] == [], "adapters differ"


def _survivors(session: int | None, marker: str) -> list[str]:
    """Processes still in `session` (None: no session of its own, as a launcher run by this process),
    or whose command line names `marker` (a launched process runs in a session of its own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # ended meanwhile
            continue
        state, _parent, _group, sid = stat.rsplit(")", 1)[1].split()[:4]
        if state != "Z" and (int(sid) == session or marker in cmdline):
            found.append(f"{entry.name}: {cmdline[:200]}")
    return found


# --- the launcher's options and the pure checks (no process started) ---------------------------


def test_accelerate_gets_the_total_and_this_machines_place() -> None:
    machines = Machines(count=2, rank=1, master_addr="10.0.0.1", master_port=29500, join_timeout_s=12.5)
    command = accelerate_command(4, ["train", "cfg.yaml"], machines=machines)
    pairs = dict(zip(command, command[1:], strict=False))
    assert pairs["--num_processes"] == "8", "accelerate's --num_processes counts every machine's"
    assert (pairs["--num_machines"], pairs["--machine_rank"]) == ("2", "1")
    assert (pairs["--main_process_ip"], pairs["--main_process_port"]) == ("10.0.0.1", "29500")
    assert pairs["--rdzv_conf"] == "timeout=13", "torch's static rendezvous waits whole seconds"
    assert command[-2:] == ["train", "cfg.yaml"]
    single = accelerate_command(2, ["train"])
    assert "--machine_rank" not in single and "--rdzv_conf" not in single


def test_machine_0_runs_torchs_agent_as_accelerate_would_with_its_store_bound() -> None:
    """Machine 0's launcher: torch's static rendezvous at --master-addr:--master-port (so that the
    other machines may use accelerate launch), this machine's processes, the join timeout."""
    from torch.distributed.run import get_args_parser

    machines = Machines(count=2, rank=0, master_addr="10.0.0.1", master_port=29500, join_timeout_s=12.5)
    command = launcher_command(4, ["train", "cfg.yaml"], machines=machines)
    assert command[1:3] == ["-m", "omni_diffusion_rl.runtime.machine_zero"]
    pairs = dict(zip(command, command[1:], strict=False))
    assert (pairs["--nproc"], pairs["--nnodes"], pairs["--join-timeout"]) == ("4", "2", "13")
    assert (pairs["--master-addr"], pairs["--master-port"]) == ("10.0.0.1", "29500")
    assert command[-3:] == ["--", "train", "cfg.yaml"]
    agent = get_args_parser().parse_args(
        torchrun_arguments(4, 2, "10.0.0.1", 29500, 13, ["train", "cfg.yaml"])
    )
    assert (agent.nnodes, agent.node_rank, agent.nproc_per_node) == ("2", 0, "4")
    assert (agent.rdzv_backend, agent.rdzv_endpoint, agent.rdzv_conf) == (
        "static",
        "10.0.0.1:29500",
        "timeout=13",
    )
    assert agent.module and agent.training_script == "omni_diffusion_rl.cli"
    assert agent.training_script_args == ["train", "cfg.yaml"] and agent.max_restarts == 0
    other = launcher_command(4, ["train"], machines=Machines(2, 1, "10.0.0.1", 29500))
    assert other[1:3] == ["-m", "accelerate.commands.launch"], "the other machines: accelerate launch"


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        (["--nnodes", "2", "--node-rank", "0"], "--nnodes 2 needs --master-port"),
        (["--nnodes", "2", "--master-port", "29500"], "--nnodes 2 needs --node-rank"),
        (["--nnodes", "2", "--node-rank", "2", "--master-port", "29500"], "--node-rank 2 is not a machine"),
        (["--node-rank", "1"], "--node-rank 1 needs --nnodes of at least 2"),
        (["--nnodes", "2", "--node-rank", "0", "--master-port", "70000"], "70000 is not a TCP port"),
        (
            ["--nnodes", "2", "--node-rank", "0", "--master-port", "29500", "--join-timeout", "0"],
            "more than 0",
        ),
    ],
)
def test_machine_options_that_cannot_start_a_run_are_refused(
    options: list[str], expected: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_diffusion_rl.cli import main
    from omni_diffusion_rl.runtime import launch

    monkeypatch.setattr(launch, "run_launched", _must_not_launch)
    assert main(["train", *options, "eval.metrics=[]"]) == 2
    err = capsys.readouterr().err
    assert err.count(expected) == 1 and "Traceback" not in err, err


def test_a_layout_indivisible_over_every_machines_processes_is_refused_before_launching(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_diffusion_rl.cli import main
    from omni_diffusion_rl.runtime import launch

    monkeypatch.setattr(launch, "run_launched", _must_not_launch)
    machine = ["--nnodes", "2", "--node-rank", "0", "--master-port", str(free_port())]
    assert main(["train", "--nproc", "2", *machine, "data.prompts_per_step=2", "eval.metrics=[]"]) == 2
    assert "data.prompts_per_step=2 must be divisible by the 4 processes" in capsys.readouterr().err


def test_a_master_port_in_use_on_machine_0_is_refused_before_launching(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from omni_diffusion_rl.cli import main
    from omni_diffusion_rl.runtime import launch

    monkeypatch.setattr(launch, "run_launched", _must_not_launch)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        machine = ["--nnodes", "2", "--node-rank", "0", "--master-port", str(port)]
        assert main(["train", *machine, "eval.metrics=[]"]) == 2
    assert f"--master-port {port} is in use on this machine (machine 0" in capsys.readouterr().err


ACCELERATE_PORT_TAKEN = (  # accelerate 1.15's output when a second --node-rank 0 took the port first
    b'Traceback (most recent call last):\n  File ".../accelerate/utils/launch.py", line 227, in '
    b"prepare_multi_gpu_env\n    raise ConnectionError(\nConnectionError: Tried to launch distributed "
    b"communication on port `29731`, but another process is utilizing it. Please specify a different port\n"
)


@pytest.mark.parametrize("launcher", ["accelerate", "machine_zero"])
def test_a_port_taken_as_the_launcher_starts_is_a_sentence_not_accelerates_traceback(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, launcher: str
) -> None:
    """Two launches with --node-rank 0 at once: both pass the port check, and the second one's
    launcher cannot listen: accelerate stopped with a ConnectionError traceback (seen on this
    machine), machine 0's own launcher with its line; either is now one sentence."""
    from omni_diffusion_rl.runtime.launch import _outcome
    from omni_diffusion_rl.runtime.machine_zero import BIND_FAILED

    machines = Machines(count=2, rank=0, master_addr="127.0.0.1", master_port=29731)
    said = ACCELERATE_PORT_TAKEN if launcher == "accelerate" else BIND_FAILED + b" 127.0.0.1:29731: in use\n"
    assert (
        _outcome(1 if launcher == "accelerate" else 2, said, str(tmp_path), machines, waited_out=False) == 2
    )
    err = capsys.readouterr().err
    assert "odrl: --master-port 29731 is in use on this machine (machine 0: taken by another process" in err
    assert "start --node-rank 0 on one machine only" in err and "Traceback" not in err, err


def test_a_run_across_machines_needs_a_shared_secret_before_launching(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Machine 0 at a network address: no secret, or one too short, is refused before anything
    starts; a secret file is read; machine 0 at a loopback address may go without one."""
    from omni_diffusion_rl.cli import main
    from omni_diffusion_rl.runtime import launch

    monkeypatch.setattr(launch, "run_launched", _must_not_launch)
    for name in ("ODRL_RUN_SECRET", "ODRL_RUN_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    machine = ["--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29500"]
    assert main(["train", *machine, "eval.metrics=[]"]) == 2
    err = capsys.readouterr().err
    assert "machine 0 at --master-addr 10.0.0.1 needs a shared secret" in err and "ODRL_RUN_SECRET=" in err, (
        err
    )
    monkeypatch.setenv("ODRL_RUN_SECRET", "short")
    assert main(["train", *machine, "eval.metrics=[]"]) == 2
    assert "the secret in ODRL_RUN_SECRET has 5 characters: use 16 to 4096" in capsys.readouterr().err
    monkeypatch.delenv("ODRL_RUN_SECRET")
    monkeypatch.setenv("ODRL_RUN_SECRET_FILE", str(tmp_path / "missing"))
    assert main(["train", *machine, "eval.metrics=[]"]) == 2
    assert "ODRL_RUN_SECRET_FILE" in capsys.readouterr().err
    (tmp_path / "secret").write_text("a-secret-of-at-least-16\n")
    monkeypatch.setenv("ODRL_RUN_SECRET_FILE", str(tmp_path / "secret"))
    Machines(count=2, rank=1, master_addr="10.0.0.1", master_port=29500).check()  # no error
    monkeypatch.delenv("ODRL_RUN_SECRET_FILE")
    Machines(count=2, rank=1, master_addr="127.0.0.1", master_port=29500).check()


def _must_not_launch(*_args: object, **_kwargs: object) -> int:
    raise AssertionError("a refused layout must not start a launcher")


def _layout(rank: int, machine: int, local: int, declared: int, config: str = "c") -> ProcessLayout:
    return ProcessLayout(rank, machine, "host", local, declared, config)


def test_machines_with_other_process_counts_are_named_with_what_to_make_equal() -> None:
    agreeing = [_layout(0, 0, 2, 4), _layout(1, 0, 2, 4), _layout(2, 1, 2, 4), _layout(3, 1, 2, 4)]
    assert layout_problem(agreeing, 4) is None
    # machine 0 told --nproc 2, machine 1 --nproc 1: torch elastic still forms a world of 3
    problem = layout_problem([_layout(0, 0, 2, 4), _layout(1, 0, 2, 4), _layout(2, 1, 1, 2)], 3)
    assert problem is not None
    assert "machine 0 (host) runs 2 processes and its launcher declared 4 in all" in problem
    assert "machine 1 (host) runs 1 process and its launcher declared 2 in all; 3 processes joined" in problem
    assert "the same --nproc (processes per machine) and --nnodes" in problem


def test_machines_given_other_configs_are_named_key_by_key() -> None:
    base = flatten({"train": {"steps": 2, "output_dir": "runs/a"}, "reward": {"weights": {"x": 1.0}}})
    assert base == {"train.steps": 2, "train.output_dir": "runs/a", "reward.weights": {"x": 1.0}}
    assert config_problem([(0, base), (1, dict(base))]) is None
    other = {**base, "train.steps": 3}
    problem = config_problem([(0, base), (0, base), (1, other)])
    assert problem is not None
    assert (
        "machine 1 was given another config than machine 0: train.steps is 3 there and 2 on machine 0"
        in problem
    )
    assert "the same config file and overrides" in problem


def test_a_process_describes_itself_from_its_launchers_environment() -> None:
    env = {"RANK": "3", "GROUP_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "2"}
    raw = describe_process({"train": {"steps": 2}}, env)
    assert (raw.rank, raw.machine, raw.local_processes, raw.declared_world) == (3, 1, 2, 4)
    declared = describe_process({"train": {"steps": 2}}, {**env, "ODRL_DECLARED_WORLD": "6"})
    assert declared.declared_world == 6 and declared.config_sha256 == raw.config_sha256
    assert describe_process({"train": {"steps": 3}}, env).config_sha256 != raw.config_sha256


def _elastic_env(port: int, rank: int) -> dict[str, str]:
    return {
        "GROUP_WORLD_SIZE": "2",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "GROUP_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def test_a_process_that_never_starts_stops_the_others_before_the_process_group() -> None:
    """torch elastic's agent store (played here by a TCPStore of this test): rank 1 died before
    the run began; rank 0 is told within the join timeout instead of waiting in init_process_group."""
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    with pytest.raises(LaunchError, match=r"process\(es\) 1 of 2 did not start within 0.5 s"):
        wait_for_every_process(0.5, _elastic_env(port, 0))
    store.set("odrl_join/none/0/1", "1")  # rank 1 arrives
    wait_for_every_process(0.5, _elastic_env(port, 0))
    wait_for_every_process(0.5, {})  # one machine, or no launcher: nothing to wait for
    del store


def test_a_store_nobody_serves_is_a_sentence() -> None:
    with pytest.raises(
        LaunchError, match=r"store on machine 0 \(127.0.0.1:\d+\) did not answer within 0.5 s"
    ):
        wait_for_every_process(0.5, _elastic_env(free_port(), 1))


# --- two launches on loopback, each playing a machine --------------------------------------------


@pytest.mark.slow  # starts launchers and training processes
def test_two_machines_of_one_process_match_one_machine_of_two(model_dir: Path, tmp_path: Path) -> None:
    """The two machines also shard the model between them (train.sharding=fsdp): one weight split
    over two machines trains what one machine's two unsharded processes do. Machine 0's store
    listens on --master-addr (127.0.0.1) only."""
    one = tmp_path / "one_machine"
    reference = _one_machine(2, fast_overrides(model_dir, one, 2))
    two = tmp_path / "two_machines"
    args, port = [*fast_overrides(model_dir, two, 2), "train.sharding=fsdp"], free_port()
    with listening.watched(os.getpid()) as seen:
        first, second = _run_machines(_machine_args(0, port, args), _machine(1, port, args))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-3000:], second.stderr[-3000:])
    if listening.READABLE:  # machine 0's store: bound to --master-addr, not to every interface
        assert {address for address, listened in seen if listened == port} == {"127.0.0.1"}, seen
    assert "sharding: FSDP2 over 2 training processes" in first.stderr
    rows_1, rows_2 = step_records(one), step_records(two)
    assert [r["step"] for r in rows_2] == [1, 2]
    # measured: every loss and reward bit for bit; only the gradient norm, summed over shards in
    # another order, 6.3e-8 apart (relative); 10x that
    for a, b in zip(rows_1, rows_2, strict=True):
        assert {k: v for k, v in b.items() if k != "grad_norm"} == {
            k: v for k, v in a.items() if k != "grad_norm"
        }
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=7e-7, abs=0)
    _assert_same_adapters(one, two)
    after = last_json_line(first.stdout)["heldout_reward_after"]
    reference_after = last_json_line(reference.stdout)["heldout_reward_after"]
    assert after == pytest.approx(reference_after, abs=1.5e-4), "4 digits kept: one rounding step apart"
    assert "{" not in second.stdout, "machine 1 has no main process: the summary is printed once"


@pytest.mark.slow  # starts launchers and training processes
def test_separate_mode_trains_on_machine_0_from_a_rollout_process_on_machine_1(
    model_dir: Path, tmp_path: Path
) -> None:
    """Machine 0 runs the trainer (rank 0), machine 1 the rollout process; machine 1 is started with
    accelerate launch and the recipe, as accelerate users do (the two launchers are interchangeable).
    The schedule is deterministic (staleness bound 0, wait), so every clock-free logged value and the
    held-out rewards equal one machine's 2 processes; timings, idle seconds and the buffer's depth
    depend on the clock (and on the network between the machines) and are left out."""
    one = tmp_path / "one_machine"
    reference = last_json_line(
        _one_machine(2, [*fast_overrides(model_dir, one, 2), *DETERMINISTIC_SEPARATE]).stdout
    )
    two = tmp_path / "two_machines"
    args, port = [*fast_overrides(model_dir, two, 2), *DETERMINISTIC_SEPARATE], free_port()
    first, second = _run_machines(_machine_args(0, port, args), _accelerate_machine(1, port, args))
    assert first.returncode == 0 and second.returncode == 0, (first.stderr[-3000:], second.stderr[-3000:])
    summary = last_json_line(first.stdout)
    assert summary["execution"]["mode"] == "separate"
    assert (summary["execution"]["trainer_replicas"], summary["execution"]["rollout_replicas"]) == (1, 1)
    assert summary["samples"]["trained"] == reference["samples"]["trained"] == 2 * 2 * 2
    assert summary["execution"]["buffer"]["staleness_histogram"] == {"0": 8}
    for key in ("heldout_reward_before", "heldout_reward_after"):
        assert summary[key] == reference[key]
    assert _clock_free(two) == _clock_free(one)
    _assert_same_adapters(one, two)


@pytest.mark.slow  # starts launchers and training processes
def test_machines_that_disagree_are_refused_before_any_step(model_dir: Path, tmp_path: Path) -> None:
    """Machine 0 says --nproc 2 and machine 1 --nproc 1 (torch elastic forms a world of 3 anyway),
    and machine 1 is given another override: every machine exits 2 with both sentences (each
    disagreement is checked on its own and named: one pair of machines shows both), no traceback."""
    run = tmp_path / "run"
    args, port = [*fast_overrides(model_dir, run, 2), "data.prompts_per_step=4"], free_port()
    first, second = _run_machines(
        _machine_args(0, port, args, nproc=2), _machine(1, port, [*args, "train.steps=3"], nproc=1)
    )
    sentences = (
        "the machines do not agree on the run's layout: machine 0 ",
        "machine 1 was given another config than machine 0: train.steps is 3",
    )
    for done in (first, second):
        assert done.returncode == 2, done.stderr[-3000:]
        for sentence in sentences:
            assert done.stderr.count(sentence) == 1, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert not (run / "metrics.jsonl").exists(), "refused before any step is logged"


@pytest.mark.slow  # starts launchers
def test_a_machine_that_never_joins_ends_the_other_with_a_sentence_and_leaves_nothing(
    model_dir: Path, tmp_path: Path
) -> None:
    """Machine 0 started alone waits for the other to join; machine 1 started alone waits for
    machine 0 to answer. Each gives up after --join-timeout with one sentence instead of torch's
    traceback, and no process of either is left. Machine 0 is a process of its own, machine 1's
    launcher this test's process (every process it launched names its run folder)."""
    runs = {rank: tmp_path / f"alone_{rank}" for rank in (0, 1)}
    args = {
        rank: _machine_args(rank, free_port(), fast_overrides(model_dir, run, 2), join_timeout_s=10)
        for rank, run in runs.items()
    }
    started = _start(odrl(*args[0]))
    ended, survivors = {}, {}
    try:
        alone = odrl_here(args[1], HERE_ENV, SAFETY_TIMEOUT_S)
        ended[1], survivors[1] = (alone.returncode, alone.stderr), _survivors(None, str(runs[1]))
        err = started.communicate(timeout=SAFETY_TIMEOUT_S)[1]
        ended[0] = (started.returncode, err)
        survivors[0] = _survivors(started.pid, str(runs[0]))
    finally:
        _kill_session(started)
    for rank, (code, err) in sorted(ended.items()):
        assert code == 1, err[-3000:]
        assert "odrl: machine(s) did not join within 10 s (--join-timeout)" in err, err[-3000:]
        assert "--node-rank (0 on the machine at --master-addr 127.0.0.1, 1 on the other)" in err
        assert "Traceback" not in err, err[-3000:]
        assert not survivors[rank], f"machine {rank} left processes behind: {survivors[rank]}"
        assert not (runs[rank] / "metrics.jsonl").exists()


class _Relay:
    """A port of its own whose connections wait until `forward()`, then are relayed to 127.0.0.1:
    `target` (a hop between machines, as a NAT makes); `reached` is set as the first one arrives."""

    def __init__(self, target: int) -> None:
        self.target, self.reached, self._go = target, threading.Event(), threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets = [self._listener]
        threading.Thread(target=self._accept, daemon=True).start()

    def forward(self) -> None:
        self._go.set()

    def close(self) -> None:
        self._go.set()
        for sock in self._sockets:
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            self._sockets.append(conn)
            self.reached.set()
            threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        self._go.wait(SAFETY_TIMEOUT_S)
        deadline = time.monotonic() + SAFETY_TIMEOUT_S
        while True:  # until machine 0's store listens
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    conn.close()
                    return
                time.sleep(0.05)
        upstream.settimeout(None)
        self._sockets.append(upstream)
        for source, sink in ((conn, upstream), (upstream, conn)):
            threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        try:
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            pass


@pytest.mark.slow  # starts launchers and training processes
def test_a_process_that_dies_before_the_run_begins_stops_the_other_machine(
    model_dir: Path, tmp_path: Path
) -> None:
    """The machines joined, but machine 1's process stops at once (its run folder is a file): machine 0's
    process is told within --join-timeout instead of waiting in init_process_group (30 min). Machine
    0's join timeout (its rendezvous too) is short, so machine 0 starts only once machine 1 is
    waiting for it: machine 1 reaches machine 0 through a relay, which holds machine 1's connection
    until machine 0 is started. Machine 1's join timeout is long, so it joins however slowly it starts."""
    port, blocked = free_port(), tmp_path / "a_file"
    blocked.write_text("not a folder")
    args = fast_overrides(model_dir, tmp_path / "run", 2)
    relay = _Relay(port)
    try:
        with ThreadPoolExecutor(1) as pool:
            machine_1 = _machine(1, relay.port, [*args, f"train.output_dir={blocked}"])
            late = pool.submit(run_process_tree, machine_1, SAFETY_TIMEOUT_S, LAUNCH_ENV, REPO)
            reached = relay.reached.wait(SAFETY_TIMEOUT_S)
            relay.forward()  # machine 1's connection goes through as soon as machine 0's store listens
            first = odrl_here(_machine_args(0, port, args, join_timeout_s=20), HERE_ENV, SAFETY_TIMEOUT_S)
            second = late.result()
    finally:
        relay.close()
    assert reached, "machine 1 never tried to reach machine 0"
    assert second.returncode == 2 and f"train.output_dir={blocked} is a file" in second.stderr, second.stderr
    assert first.returncode == 2, first.stderr[-3000:]
    expected = "odrl: LaunchError: process(es) 1 of 2 did not start within 20 s (--join-timeout)"
    assert expected in first.stderr, first.stderr[-3000:]
    assert "Traceback" not in first.stderr + second.stderr


def _start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        command,
        cwd=REPO,
        env=LAUNCH_ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _kill_session(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
