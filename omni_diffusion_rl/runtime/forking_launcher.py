"""The launcher of `odrl train --nproc N` on one machine: it imports once and forks the N processes.

`accelerate launch` (torch's elastic agent) starts a fresh interpreter for itself (about 1.5 CPU-s)
and for every training process, and each of those imports torch, diffusers, transformers and peft
again (about 4 CPU-s on a CPU machine, more than a short run trains). This agent, on a machine
without CUDA, imports them once and forks its processes from there; on a CUDA machine it forks
before any import, so that each process initialises its own device (a process that forked after
CUDA was touched cannot use it).

The processes get the environment the elastic agent gives its own (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR/PORT, the agent-store variables and accelerate's), so the training code is the same
under both. The run's store is hosted here, on a socket bound to 127.0.0.1 only, and gloo listens
on the loopback interface only (GLOO_SOCKET_IFNAME, unless set): nothing of a one-machine run can
be reached from another machine. When a process fails, the others are stopped and the agent exits
with the first failure's code; SIGTERM or SIGINT stops every process (SIGTERM, then SIGKILL after
STOP_GRACE_S). The processes die with the agent (lifeline.exit_with_parent, armed by `odrl train`).
"""

from __future__ import annotations

import argparse
import os
import runpy
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from typing import NoReturn

from .launch_parts import ACCELERATE_VARIABLES, ENTRY_MODULE, REFUSED_CODE, after_dashes, listen, store_on
from .startup import TRAINING_STACK, import_frozen

# What each process imports before its first step (imported once here on CPU machines, with the
# garbage collector paused and then frozen: startup.py).
PRELOAD = (*TRAINING_STACK, "omni_diffusion_rl.trainers.trainer")
STOP_GRACE_S = 15.0  # after SIGTERM, before SIGKILL
STORE_TIMEOUT_S = 1800.0  # how long the store waits on a request (torch's default)
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # stop every process, then the agent
LOOPBACK_INTERFACE = "lo"  # Linux's name; elsewhere gloo keeps its own choice


def agent_command(nproc: int, args: Sequence[str], port: int = 0) -> list[str]:
    """The command that runs `python -m omni_diffusion_rl.cli ARGS` in `nproc` processes here,
    meeting at 127.0.0.1:`port` (0: a free one)."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    agent = [sys.executable, "-m", __name__, "--nproc", str(nproc), "--port", str(port)]
    return [*agent, "--", *args]


def process_environment(
    base: Mapping[str, str], rank: int, nproc: int, port: int, address: str = "127.0.0.1"
) -> dict[str, str]:
    """The environment of process `rank` of `nproc`: what torch's elastic agent and accelerate
    launch set for their processes on one machine."""
    env = dict(base)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(nproc),
        MASTER_ADDR=address,
        MASTER_PORT=str(port),
        TORCHELASTIC_USE_AGENT_STORE="True",  # every process is a client of the store hosted here
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_RUN_ID="odrl-local",  # also tells lifeline.exit_with_parent that a launcher started it
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
    )
    env.update(ACCELERATE_VARIABLES)
    env.setdefault("OMP_NUM_THREADS", "1")  # as the elastic agent: one thread each unless the user chose
    if "GLOO_SOCKET_IFNAME" not in env and _has_interface(LOOPBACK_INTERFACE):
        env["GLOO_SOCKET_IFNAME"] = LOOPBACK_INTERFACE
    return env


def _has_interface(name: str) -> bool:
    try:
        return any(found == name for _, found in socket.if_nameindex())
    except OSError:
        return False


def _uses_cuda(env: Mapping[str, str]) -> bool:
    """Whether the processes may use CUDA (then nothing is imported before the fork)."""
    return env.get("ACCELERATE_USE_CPU", "").lower() not in ("1", "true", "yes")


class _Stop(Exception):
    """SIGTERM or SIGINT reached the agent."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signum)


def _listen(address: str, port: int) -> socket.socket:
    """The store's socket, bound to `address` only; a sentence when the port is taken."""
    try:
        return listen(address, port)
    except OSError as e:
        raise SystemExit(
            f"odrl: cannot listen on {address}:{port} ({e.strerror}): choose another port, or stop the "
            "process that holds it"
        ) from None


def _fork_process(env: Mapping[str, str], args: Sequence[str], listener: socket.socket) -> int:
    """Fork a process with environment `env` (process_environment's); the child runs the entry
    point and never returns (see _run_process)."""
    sys.stdout.flush()
    sys.stderr.flush()
    # Signals wait until the child has its own handlers (the agent's would stop its siblings).
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    pid = os.fork()
    if pid == 0:
        _run_process(env, args, listener)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    return pid


def _run_process(env: Mapping[str, str], args: Sequence[str], listener: socket.socket) -> NoReturn:
    """In a forked child: take `env` and run `python -m ENTRY_MODULE ARGS`. It ends as an
    interpreter ends (SystemExit: atexit handlers, non-daemon threads, flushed output), never back
    in the agent."""
    listener.close()  # the store is the agent's
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    os.environ.clear()
    os.environ.update(env)
    threads = os.environ["OMP_NUM_THREADS"]
    if "torch" in sys.modules and threads.isdigit():  # torch read the agent's value at import
        sys.modules["torch"].set_num_threads(max(1, int(threads)))
    sys.argv = [ENTRY_MODULE, *args]
    runpy.run_module(ENTRY_MODULE, run_name="__main__", alter_sys=True)  # as `python -m` runs it
    raise SystemExit(0)  # the module ended without sys.exit


def _exit_code(status: int) -> int:
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code  # killed by signal N: 128 + N, as a shell says


def _how_it_ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        try:
            return f"was killed ({signal.Signals(number).name})"
        except ValueError:  # a signal without a name (real-time)
            return f"was killed (signal {number})"
    return f"ended with exit code {os.waitstatus_to_exitcode(status)}"


def _stop(pids: dict[int, int], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every process left, SIGKILL those still there after `grace_s`; reap them all."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while pids and time.monotonic() < deadline:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.05)
            else:
                pids.pop(pid, None)
        if not pids:
            return


def _wait(pids: dict[int, int], nproc: int) -> int:
    """Wait for every process; the first failure stops the others and gives the exit code."""
    failure = 0
    while pids:
        pid, status = os.waitpid(-1, 0)
        rank = pids.pop(pid, None)
        if rank is None:
            continue
        code = _exit_code(status)
        if code and not failure:
            failure = code
            if code != REFUSED_CODE:  # a refusal said why itself; a crash or a kill is named here
                how = _how_it_ended(status)
                print(
                    f"odrl: training process {rank} of {nproc} {how}; stopping the others",
                    file=sys.stderr,
                    flush=True,
                )
            _stop(pids)
    return failure


def run(nproc: int, args: Sequence[str], port: int = 0, address: str = "127.0.0.1") -> int:
    """Start `python -m ENTRY_MODULE ARGS` in `nproc` processes meeting at address:port (0: a free
    port, bound here before the processes start, so no other process can take it in between); the
    run's exit code."""
    base_env = dict(os.environ)
    listener = _listen(address, port)
    port = int(listener.getsockname()[1])
    if not _uses_cuda(base_env):  # CPU: import once, every process shares it
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # read by torch at import
        import_frozen(PRELOAD)
    pids: dict[int, int] = {}
    previous = {sig: signal.signal(sig, _raise_stop) for sig in STOP_SIGNALS}
    try:
        for rank in range(nproc):
            env = process_environment(base_env, rank, nproc, port)
            pids[_fork_process(env, args, listener)] = rank
        store = store_on(listener, address, port, STORE_TIMEOUT_S)  # after the forks: its threads stay here
        try:
            return _wait(pids, nproc)
        finally:
            del store
    except _Stop as stop:
        for sig in STOP_SIGNALS:  # stopping already
            signal.signal(sig, signal.SIG_IGN)
        _stop(pids)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        listener.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_diffusion_rl.runtime.forking_launcher")
    parser.add_argument("--nproc", type=int, required=True, help="processes to start on this machine")
    parser.add_argument("--port", type=int, default=0, help="the store's port on 127.0.0.1 (0: a free one)")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the odrl command line")
    ns = parser.parse_args(argv)
    if ns.nproc < 1:
        parser.error(f"--nproc {ns.nproc}: give at least 1")
    return run(ns.nproc, after_dashes(ns.args), ns.port)


if __name__ == "__main__":
    sys.exit(main())
