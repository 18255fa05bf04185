"""Running a multi-process job (a launcher and the processes it starts) to its end, or stopping all
of it: a launcher killed on a timeout would otherwise leave its training processes running. The
launcher also dies with the caller (lifeline.parent_death_preexec), and the training processes
with their launcher (lifeline.exit_with_parent; torch starts each in a session of its own).

Started from another thread than the main one, the child runs no Python code between fork and exec
(no preexec_fn): in a forked copy of a process with other threads running, that code can crash
(SIGSEGV before the command even starts, seen in a test worker that had run many tests). It is told
instead (lifeline.OVERRIDE_VARIABLE) to arm its own lifeline: an `odrl` command or a recipe does
so first thing, and a launcher's processes die with their launcher either way."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .lifeline import OVERRIDE_VARIABLE, parent_death_preexec


def run_process_tree(
    command: Sequence[str],
    timeout_s: float,
    env: Mapping[str, str] | None = None,
    cwd: str | Path | None = None,
    started: Callable[[subprocess.Popen[str]], None] | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run `command` in its own session and capture its text output. Past `timeout_s`, every
    process of the session is killed and subprocess.TimeoutExpired is raised (with the output).
    `started` is told the process as it starts (a caller on another thread may `kill_session` it)."""
    child_env = dict(env if env is not None else os.environ)
    if threading.current_thread() is not threading.main_thread():
        child_env[OVERRIDE_VARIABLE] = "1"  # it arms its own lifeline (module docstring)
    proc = subprocess.Popen(
        list(command),
        cwd=cwd,
        env=child_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=parent_death_preexec(),  # noqa: PLW1509 - one prctl call, main thread only
    )
    if started is not None:
        started(proc)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_session(proc)
        stdout, stderr = proc.communicate()
        raise subprocess.TimeoutExpired(proc.args, timeout_s, stdout, stderr) from None
    except BaseException:  # interrupted: leave nothing behind
        kill_session(proc)
        proc.communicate()
        raise
    kill_session(proc)  # processes the launcher left behind
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def kill_session(proc: subprocess.Popen[str]) -> None:
    """SIGKILL every process of `proc`'s session (started with start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # the session has no process left
        pass
