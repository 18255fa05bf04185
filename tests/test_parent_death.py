"""A launched process dies with its launcher (omni_diffusion_rl.runtime.lifeline): real processes killed
with SIGKILL, the training processes of `accelerate launch` included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from omni_diffusion_rl.runtime import lifeline
from omni_diffusion_rl.runtime.launch import launcher_command

from .helpers import ENV, REPO, fast_overrides, tiny_model_dir

pytestmark = pytest.mark.slow  # multi-process runs: left out of `make test-fast`

# No launcher's variables unless a test sets them.
PLAIN_ENV = {
    k: v for k, v in ENV.items() if k not in (*lifeline.LAUNCHER_VARIABLES, lifeline.OVERRIDE_VARIABLE)
}
PLAIN_ENV["PYTHONPATH"] = str(REPO)

# A "worker": arms the lifeline, then writes its pid and sleeps (argv: pid file, then "ignore-term"
# to leave SIGTERM unheeded so that only the watchdog can stop it).
WORKER = """
import os, signal, sys, time
from omni_diffusion_rl.runtime.lifeline import exit_with_parent
armed = exit_with_parent(poll_s=0.2)
if "ignore-term" in sys.argv:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(sys.argv[1], "w").write(f"{os.getpid()} {armed}")
time.sleep(60)
"""
# A worker started without a launcher's variables (argv: pid file, go file): once told to go, it writes
# its parent then and now beside its pid file, and ends.
PLAIN_WORKER = """
import os, sys, time
from omni_diffusion_rl.runtime.lifeline import exit_with_parent
armed = exit_with_parent(poll_s=0.2)
parent = os.getppid()
open(sys.argv[1], "w").write(f"{os.getpid()} {armed}")
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
open(sys.argv[1] + ".survived", "w").write(f"{parent} {os.getppid()}")
"""
# A worker whose launcher dies before it arms the lifeline (argv: pid file, go file).
LATE_WORKER = """
import os, sys, time
from omni_diffusion_rl.runtime import lifeline
from omni_diffusion_rl.runtime.launch import launcher_command
open(sys.argv[1], "w").write(str(os.getpid()))
while not os.path.exists(sys.argv[2]):
    time.sleep(0.05)
lifeline.exit_with_parent()
open(sys.argv[1] + ".survived", "w").write("survived")
time.sleep(60)
"""
# A "launcher": starts the worker given as argv[1:] in a session of its own (as torch does) and waits.
LAUNCHER = """
import subprocess, sys, time
subprocess.Popen(sys.argv[1:], start_new_session=True)
time.sleep(120)
"""
# A "benchmark": starts a sleeping launcher with run_process_tree, which writes its pid.
BENCH = """
import sys
from omni_diffusion_rl.runtime.subprocesses import run_process_tree
sleeper = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
run_process_tree([sys.executable, "-c", sleeper, sys.argv[1]], timeout_s=120)
"""

# Starts a reward server through ServerProcess, writes its pid, then waits (argv: pid file).
SERVER_OWNER = """
import sys, time
from omni_diffusion_rl.serving.process import ServerProcess
server = ServerProcess(["color_match"]).start()
open(sys.argv[1], "w").write(str(server.proc.pid))
time.sleep(120)
"""


def _state(pid: int) -> str | None:
    """The process's state letter (R, S, Z, ...), or None when it does not exist."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _gone(pid: int) -> bool:
    return _state(pid) in (None, "Z", "X")  # a zombie no one reaps has exited


def _wait_for(condition: Callable[[], bool], timeout_s: float, step_s: float = 0.05) -> float | None:
    """Seconds until `condition()` held, or None if it did not within `timeout_s`."""
    start = time.monotonic()
    while True:
        if condition():
            return time.monotonic() - start
        if time.monotonic() - start > timeout_s:
            return None
        time.sleep(step_s)


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            found.append(int(entry.name))
    return found


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@contextmanager
def _session(command: list[str], env: dict[str, str], **kwargs: object) -> Iterator[subprocess.Popen]:
    """`command` in its own session; afterwards every process of the session is killed."""
    proc = subprocess.Popen(command, env=env, cwd=REPO, start_new_session=True, **kwargs)
    try:
        yield proc
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def _worker_under_killed_launcher(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[int, Path]:
    """Start launcher -> worker, wait until the worker runs, SIGKILL the launcher; the worker's pid
    and its stderr file."""
    pid_file, err_file = tmp_path / "worker.pid", tmp_path / "worker.err"
    worker = [sys.executable, "-c", WORKER, str(pid_file), *args]
    with (
        open(err_file, "w") as err,
        _session([sys.executable, "-c", LAUNCHER, *worker], env, stderr=err) as p,
    ):
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30) is not None
        pid_text, armed = pid_file.read_text().split()
        pid = int(pid_text)
        assert armed == str("TORCHELASTIC_RUN_ID" in env or env.get(lifeline.OVERRIDE_VARIABLE) == "1")
        p.kill()
        p.wait(timeout=10)
    return pid, err_file


def test_a_launched_process_exits_when_its_launcher_is_killed(tmp_path: Path) -> None:
    pid, _ = _worker_under_killed_launcher(tmp_path, {**PLAIN_ENV, "TORCHELASTIC_RUN_ID": "test"})
    try:
        assert _wait_for(lambda: _gone(pid), 5) is not None, "the worker outlived its launcher"
    finally:
        _kill(pid)


def test_the_watchdog_exits_a_launched_process_that_ignores_sigterm(tmp_path: Path) -> None:
    env = {**PLAIN_ENV, "TORCHELASTIC_RUN_ID": "test"}
    pid, err = _worker_under_killed_launcher(tmp_path, env, "ignore-term")
    try:
        assert _wait_for(lambda: _gone(pid), 5) is not None, "the worker outlived its launcher"
        assert "is gone; exiting" in err.read_text()
    finally:
        _kill(pid)


def test_a_process_not_started_by_a_launcher_outlives_its_parent(tmp_path: Path) -> None:
    """`nohup odrl train &` from a shell must survive the shell: told to go only once its launcher is
    dead and reaped (a lifeline's death signal is sent as the launcher exits), the worker writes that
    it survived, with its parent changed. The 30 s only stops a hang."""
    pid_file, go = tmp_path / "worker.pid", tmp_path / "go"
    worker = [sys.executable, "-c", PLAIN_WORKER, str(pid_file), str(go)]
    with _session([sys.executable, "-c", LAUNCHER, *worker], PLAIN_ENV) as launcher:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30) is not None
        pid_text, armed = pid_file.read_text().split()
        assert armed == "False"
        launcher.kill()
        launcher.wait(timeout=10)
    survived = Path(f"{pid_file}.survived")
    try:
        go.touch()
        assert _wait_for(survived.exists, 30) is not None, "a plain process died with its parent"
        parents = survived.read_text().split()
        assert parents[0] != parents[1], parents  # reparented: its launcher was gone when it wrote
    finally:
        _kill(int(pid_text))


def test_a_launched_process_whose_launcher_died_before_it_armed_exits(tmp_path: Path) -> None:
    pid_file, go = tmp_path / "worker.pid", tmp_path / "go"
    worker = [sys.executable, "-c", LATE_WORKER, str(pid_file), str(go)]
    env = {**PLAIN_ENV, "TORCHELASTIC_RUN_ID": "test"}
    with _session([sys.executable, "-c", LAUNCHER, *worker], env) as launcher:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30) is not None
        pid = int(pid_file.read_text())
        launcher.kill()
        launcher.wait(timeout=10)
    try:
        go.touch()
        assert _wait_for(lambda: _gone(pid), 5) is not None
        assert not Path(f"{pid_file}.survived").exists()
    finally:
        _kill(pid)


def test_a_benchmarks_launcher_dies_with_the_benchmark(tmp_path: Path) -> None:
    """run_process_tree starts the launcher in its own session; a killed caller takes it down."""
    pid_file = tmp_path / "launcher.pid"
    with _session([sys.executable, "-c", BENCH, str(pid_file)], PLAIN_ENV) as bench:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 30) is not None
        pid = int(pid_file.read_text())
        bench.kill()
        bench.wait(timeout=10)
    try:
        assert _wait_for(lambda: _gone(pid), 5) is not None, "the launcher outlived the benchmark"
    finally:
        _kill(pid)


@pytest.mark.slow
def test_a_reward_server_started_by_server_process_dies_with_its_owner(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    env = {**PLAIN_ENV, "HF_HUB_OFFLINE": "1"}
    with _session([sys.executable, "-c", SERVER_OWNER, str(pid_file)], env) as owner:
        assert _wait_for(lambda: pid_file.exists() and pid_file.read_text(), 60) is not None
        pid = int(pid_file.read_text())
        try:
            owner.kill()  # SIGKILL: no cleanup code of the owner runs
            owner.wait(timeout=10)
            # checked before the session ends (its killpg would stop the server regardless)
            assert _wait_for(lambda: _gone(pid), 5) is not None, "the reward server outlived its owner"
        finally:
            _kill(pid)


@pytest.mark.parametrize("launcher", ["accelerate", "forking"])
def test_killing_the_launcher_takes_its_training_processes_down(tmp_path: Path, launcher: str) -> None:
    """SIGKILL of the launcher (the workers' parent: torch's elastic agent in `accelerate launch`, or
    the forking launcher of `odrl train --nproc`) while 2 CPU processes train: both exit within
    seconds instead of training on unsupervised."""
    run = tmp_path / "run"
    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), run, 100000)
    overrides += ["train.eval_at_start_and_end=false", "train.checkpoint_every=0", "tracking.wandb=false"]
    config = str(REPO / "recipes" / "configs" / "tiny_t2av_nft.yaml")
    if launcher == "accelerate":
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
        command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        command += [
            "--main_process_port",
            "29577",
            str(REPO / "recipes" / "train_nft.py"),
            config,
            *overrides,
        ]
    else:
        command = launcher_command(2, ["train", config, *overrides])
    env = {**PLAIN_ENV, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    metrics = run / "metrics.jsonl"
    log = tmp_path / "launch.log"
    workers: list[int] = []  # torch starts each in a session of its own: killed one by one at the end
    try:
        with open(log, "w") as out, _session(command, env, stdout=out, stderr=subprocess.STDOUT) as launcher:
            training = _wait_for(lambda: metrics.exists() and "reward/mean" in metrics.read_text(), 90, 0.5)
            assert training is not None, f"no training step within 90 s:\n{log.read_text()[-3000:]}"
            workers += _children(launcher.pid)
            assert len(workers) == 2, workers
            launcher.kill()
            launcher.wait(timeout=10)
            died = _wait_for(lambda: all(_gone(pid) for pid in workers), 20, 0.1)
            print(f"workers {workers} gone {died} s after the launcher's SIGKILL")
            assert died is not None, f"training processes {workers} outlived their launcher by 20 s"
    finally:
        for pid in workers:
            _kill(pid)


def _descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children, their children, ...)."""
    found, frontier = [], [pid]
    while frontier:
        children = [c for p in frontier for c in _children(p)]
        found += children
        frontier = children
    return found


def test_sigterm_of_a_benchmark_stops_its_launcher_and_training_processes(tmp_path: Path) -> None:
    """`odrl bench modes` runs 2-process trainings through a launcher; SIGTERM of the bench (a user's
    `kill`) stops the launcher and both training processes, not only the bench."""
    model = tiny_model_dir(tmp_path / "model")
    overrides = [o for o in fast_overrides(model, tmp_path / "unused", 2) if "output_dir" not in o]
    command = [sys.executable, "-m", "omni_diffusion_rl.cli", "bench", "modes", "--steps", "100000"]
    command += ["--output", str(tmp_path / "bench" / "modes.json"), *overrides]
    env = {**PLAIN_ENV, "OMP_NUM_THREADS": "1"}
    tree: list[int] = []
    try:
        with (
            open(tmp_path / "bench.log", "w") as out,
            _session(command, env, stdout=out, stderr=out) as bench,
        ):
            started = _wait_for(lambda: len(_descendants(bench.pid)) >= 3, 120, 0.5)  # launcher + 2 workers
            assert started is not None, (tmp_path / "bench.log").read_text()[-3000:]
            time.sleep(3)  # the workers are past their start-up
            tree = _descendants(bench.pid)
            bench.send_signal(signal.SIGTERM)
            bench.wait(timeout=20)
            died = _wait_for(lambda: all(_gone(pid) for pid in tree), 30, 0.2)
            print(f"{len(tree)} processes below the bench gone {died} s after its SIGTERM")
            assert died is not None, f"processes {[p for p in tree if not _gone(p)]} outlived the bench"
    finally:
        for pid in tree:
            _kill(pid)


@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"]
)
def test_odrl_train_nproc_stops_every_process_it_started(tmp_path: Path, sig: signal.Signals) -> None:
    """`odrl train --nproc 2` starts its launcher itself; Ctrl-C, SIGTERM or SIGKILL of it stops the
    launcher and both training processes."""
    run = tmp_path / "run"
    overrides = fast_overrides(tiny_model_dir(tmp_path / "model"), run, 100000)
    overrides += ["train.eval_at_start_and_end=false", "train.checkpoint_every=0", "tracking.wandb=false"]
    command = [sys.executable, "-m", "omni_diffusion_rl.cli", "train", "--nproc", "2", *overrides]
    env = {**PLAIN_ENV, "OMP_NUM_THREADS": "1"}
    metrics = run / "metrics.jsonl"
    tree: list[int] = []
    try:
        with open(tmp_path / "train.log", "w") as out, _session(command, env, stdout=out, stderr=out) as odrl:
            training = _wait_for(lambda: metrics.exists() and "reward/mean" in metrics.read_text(), 90, 0.5)
            assert training is not None, (tmp_path / "train.log").read_text()[-3000:]
            tree = _descendants(odrl.pid)
            assert len(tree) >= 3, tree  # the launcher and 2 training processes
            odrl.send_signal(sig)
            assert odrl.wait(timeout=30) in (130, -sig, 128 + sig, 1), "odrl stops"
            died = _wait_for(lambda: all(_gone(pid) for pid in tree), 30, 0.2)
            print(f"{len(tree)} processes gone {died} s after odrl's {sig.name}")
            assert died is not None, f"processes {[p for p in tree if not _gone(p)]} outlived odrl"
    finally:
        for pid in tree:
            _kill(pid)


# A process waiting in launch._wait for a child that ends on SIGTERM. Once _wait's handler is in place
# (a marker file says so), the child sends the waiting process SIGTERM. The stop's waits are 10 minutes:
# the wait returns only if the child is reaped as soon as it ends.
SIGTERMED_WAIT = """
import signal, subprocess, sys
from pathlib import Path
from omni_diffusion_rl.runtime import launch

marker = Path(sys.argv[1])
launch.STOP_SIGNALS = ((signal.SIGTERM, 600.0), (signal.SIGKILL, 600.0))
install = signal.signal
def noting(sig, handler):
    previous = install(sig, handler)
    if sig == signal.SIGTERM and handler is launch._raise_terminated:
        marker.write_text("installed")
    return previous
signal.signal = noting
child = subprocess.Popen([sys.executable, "-c", '''
import os, signal, sys, time
from pathlib import Path
while not Path(sys.argv[1]).exists():
    time.sleep(0.01)
os.kill(os.getppid(), signal.SIGTERM)
time.sleep(600)
''', str(marker)], start_new_session=True)
print(launch._wait(child), child.returncode, flush=True)
"""


def test_sigterm_of_the_launcher_wait_reaps_its_launcher_at_once(tmp_path: Path) -> None:
    """`odrl train --nproc N`'s wait on SIGTERM stops the launcher's session and returns 143. Stopping
    from inside the signal handler, as it once did, could not reap the launcher while the interrupted
    wait held Popen's lock: each stop wait ran out (here 10 minutes, so that run ends by the hang stop)."""
    done = subprocess.run(
        [sys.executable, "-c", SIGTERMED_WAIT, str(tmp_path / "installed")],
        capture_output=True,
        text=True,
        env=PLAIN_ENV,
        cwd=REPO,
        timeout=120,  # a hang stop: the fixed wait returns as soon as the child is gone
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["(143,", "True)", "-15"], done.stdout
