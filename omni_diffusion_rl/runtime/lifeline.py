"""A process started by a launcher dies with its launcher.

`accelerate launch` (torch's elastic agent) is the parent of the training processes; killed with
SIGKILL it cannot stop them, and they would train on unsupervised until they finish. A launched
process calls `exit_with_parent()` first thing: on Linux the kernel sends it SIGTERM when its
parent dies (PR_SET_PDEATHSIG), and a watchdog thread exits it when its parent changes (other
systems, or a SIGTERM handled without exiting). A process started from a shell (`nohup odrl train
&`) is left alone: it must outlive its shell.

`parent_death_preexec()` gives the same to a child started with subprocess (a launcher started by
a benchmark dies with the benchmark).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping

PR_SET_PDEATHSIG = 1  # linux/prctl.h
# Set by torch's elastic agent (torchrun, `accelerate launch` with several processes) and by every
# `accelerate launch` (its single-process launcher too) in the processes they start; a user does
# not set these in a shell.
LAUNCHER_VARIABLES = ("TORCHELASTIC_RUN_ID", "ACCELERATE_DYNAMO_MODE")
# "1": exit with the parent even without a launcher's variables; "0": never (a launched run that
# must outlive its launcher).
OVERRIDE_VARIABLE = "ODRL_EXIT_WITH_PARENT"
EXIT_CODE = 128 + signal.SIGTERM  # as if terminated
POLL_S = 1.0

# Who this process's parent was when it started: recorded at import, so that a parent that died
# between the start and the call of exit_with_parent() is still noticed.
_STARTED = (os.getpid(), os.getppid())
_enabled_for: int | None = None  # the pid that enabled the lifeline (a forked child must do it again)
_lock = threading.Lock()


def started_by_launcher(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the lifeline applies to a process with this environment (default: this process's)."""
    env = os.environ if environ is None else environ
    override = env.get(OVERRIDE_VARIABLE, "").strip()
    if override in ("0", "1"):
        return override == "1"
    return any(env.get(name) for name in LAUNCHER_VARIABLES)


def exit_with_parent(poll_s: float = POLL_S) -> bool:
    """When started by a launcher, make this process exit when its parent dies; returns whether
    it did. Idempotent; exits at once (EXIT_CODE) when the parent is already gone."""
    global _enabled_for
    if not started_by_launcher():
        return False
    with _lock:
        if _enabled_for == os.getpid():
            return True
        pid, parent = _STARTED
        if pid != os.getpid():  # a forked child of the process that imported this module
            parent = os.getppid()
        _set_death_signal(signal.SIGTERM)
        _exit_if_orphaned(parent)  # the parent died before the death signal was armed
        watchdog = threading.Thread(target=_watch, args=(parent, poll_s), name="odrl-lifeline", daemon=True)
        watchdog.start()
        _enabled_for = os.getpid()
    return True


def parent_death_preexec(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A subprocess preexec_fn that makes the child receive `sig` when this process dies (the
    signal survives exec), or None where the system cannot do it. Prepared here, before the
    fork: the child only makes one system call. None off the main thread too: the signal fires
    when the starting thread ends, not the process, and Python code run in a forked copy of a
    process whose other threads are running can crash (SIGSEGV before the command starts)."""
    prctl = _prctl()
    if prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()

    def arm() -> None:
        prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:  # this process died during the fork
            os._exit(EXIT_CODE)

    return arm


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    return prctl


def _set_death_signal(sig: int) -> bool:
    prctl = _prctl()
    return prctl is not None and prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0


def _exit_if_orphaned(parent: int) -> None:
    if os.getppid() == parent:
        return
    message = f"odrl: the launcher (pid {parent}) that started process {os.getpid()} is gone; exiting\n"
    # stderr may be a pipe nobody reads any more: the message gets a second, the exit is certain
    writer = threading.Thread(target=_write_stderr, args=(message.encode(),), daemon=True)
    writer.start()
    writer.join(1.0)
    os._exit(EXIT_CODE)


def _write_stderr(data: bytes) -> None:
    try:
        os.write(2, data)
    except OSError:
        pass


def _watch(parent: int, poll_s: float) -> None:
    while True:
        time.sleep(poll_s)
        _exit_if_orphaned(parent)
