"""A launcher's whole process tree is stopped on a timeout (real processes, a few seconds)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from omni_diffusion_rl.runtime.subprocesses import run_process_tree

# A "launcher" that starts a "worker", which writes its pid and sleeps far past the timeout.
WORKER = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
LAUNCHER = f"""
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", {WORKER!r}, sys.argv[1]])
print("launched", flush=True)
time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow  # starts training or launcher processes
def test_a_timeout_kills_the_launcher_and_what_it_started(tmp_path: Path) -> None:
    pid_file = tmp_path / "worker.pid"
    with pytest.raises(subprocess.TimeoutExpired) as caught:  # without it, the launcher ends after 60 s
        run_process_tree([sys.executable, "-c", LAUNCHER, str(pid_file)], timeout_s=3)
    assert "launched" in (caught.value.stdout or "")
    worker = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(worker) and time.monotonic() < deadline:  # a zombie until its parent is reaped
        time.sleep(0.05)
    assert not _alive(worker) or _is_zombie(worker), "the worker outlived its launcher's timeout"


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_a_finished_run_returns_its_output_and_code() -> None:
    done = run_process_tree([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout_s=30)
    assert (done.returncode, done.stdout.strip()) == (3, "out")


# The child's parent-death signal (prctl PR_GET_PDEATHSIG) and the lifeline variable it was given.
REPORT_LIFELINE = """
import ctypes, os
signal = ctypes.c_int(0)
ctypes.CDLL(None, use_errno=True).prctl(2, ctypes.byref(signal), 0, 0, 0)
print(signal.value, os.environ.get("ODRL_EXIT_WITH_PARENT", "unset"))
"""


@pytest.mark.slow  # starts processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_child_started_off_the_main_thread_runs_no_python_before_exec_and_arms_itself() -> None:
    """From the main thread the death signal is armed between fork and exec (SIGTERM, 15); from
    another thread nothing runs there (Python code in a forked copy of a threaded process can crash)
    and the child is told to arm its own lifeline instead."""
    import threading

    env = {k: v for k, v in os.environ.items() if k != "ODRL_EXIT_WITH_PARENT"}
    command = [sys.executable, "-c", REPORT_LIFELINE]
    assert run_process_tree(command, 60, env=env).stdout.split() == ["15", "unset"]
    outputs: list[str] = []
    thread = threading.Thread(target=lambda: outputs.append(run_process_tree(command, 60, env=env).stdout))
    thread.start()
    thread.join(timeout=60)
    assert outputs and outputs[0].split() == ["0", "1"], outputs
    assert "ODRL_EXIT_WITH_PARENT" not in env, "the caller's environment is left as it was"
