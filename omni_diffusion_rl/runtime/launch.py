"""One launcher for several training processes: `odrl train --nproc N` and the benchmarks.

On one machine it is the forking launcher (forking_launcher.py: one import for all processes, its
store on 127.0.0.1 only); on several, torch's elastic agent: on machine 0 in a launcher that binds
its store to --master-addr (machine_zero.py), on the others through `accelerate launch`. Both run the
module entry point of the installed package (no recipes folder needed; on a machine without CUDA
the processes run on CPU over gloo), in a session of their own that dies with the caller; Ctrl-C or
SIGTERM of the caller stops the launcher and every process it started.

A run on several machines (`odrl train --nnodes M --node-rank R --master-addr A --master-port P`)
starts one such launcher per machine; they meet in torch elastic's static rendezvous on machine 0,
which waits at most the join timeout. A launcher whose machines did not all join ends with one
sentence instead of torch's traceback (its stderr is held back until its processes start).
"""

from __future__ import annotations

import math
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO

from ..config import ConfigError
from .forking_launcher import agent_command
from .launch_check import DECLARED_WORLD_VARIABLE, LAUNCH_DIR_VARIABLE, REFUSED, STARTED, marked
from .lifeline import parent_death_preexec
from .machine_zero import BIND_FAILED, machine_zero_command
from .run_secret import run_secret, secret_needed_problem


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class Machines:
    """Where one launcher's processes sit among the machines of a run (`odrl train --nnodes ...`)."""

    count: int = 1
    rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    join_timeout_s: float = 300.0

    def check(self) -> None:
        """A ConfigError saying what to give when the options cannot start a run."""
        if self.join_timeout_s <= 0:
            raise ConfigError(
                f"--join-timeout {self.join_timeout_s:g}: give the seconds to wait, more than 0"
            )
        if self.master_port is not None and not 1 <= self.master_port <= 65535:
            raise ConfigError(f"--master-port {self.master_port} is not a TCP port: use one in 1024-65535")
        if self.count == 1:
            if self.rank:
                raise ConfigError(f"--node-rank {self.rank} needs --nnodes of at least {self.rank + 1}")
            return
        if self.master_port is None:
            raise ConfigError(
                f"--nnodes {self.count} needs --master-port: a free TCP port on machine 0 (the one at "
                "--master-addr) that every machine can reach, the same in every machine's command, e.g. "
                "--master-port 29500"
            )
        if not 0 <= self.rank < self.count:
            raise ConfigError(
                f"--node-rank {self.rank} is not a machine of --nnodes {self.count}: give 0 on the machine "
                f"at --master-addr and 1 .. {self.count - 1} on the others, each machine its own"
            )
        problem = secret_needed_problem(self.master_addr, self.count, run_secret())
        if problem:
            raise ConfigError(problem)

    def check_port_free(self) -> None:
        """On machine 0: a ConfigError when --master-port is taken here (the rendezvous listens on it)."""
        if self.count == 1 or self.rank != 0 or self.master_port is None:
            return
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", self.master_port))
            except OSError as e:
                raise ConfigError(self.port_taken(e.strerror)) from None

    def port_taken(self, why: str) -> str:
        """The sentence for a --master-port that machine 0 cannot listen on."""
        return (
            f"--master-port {self.master_port} is in use on this machine (machine 0: {why}); another run, "
            "or a second launch with --node-rank 0, holds it: choose a free port, the same in every "
            "machine's command, and start --node-rank 0 on one machine only"
        )

    def join_failure(self, detail: str) -> str:
        """The sentence for a rendezvous that timed out (`detail`: torch's last line)."""
        others = "1 on the other" if self.count == 2 else f"1 .. {self.count - 1} on the others"
        said = f" (torch: {detail})" if detail else ""
        return (
            f"odrl: machine(s) did not join within {self.join_timeout_s:g} s (--join-timeout): start the "
            f"same `odrl train ... --nnodes {self.count}` on every machine, each with its own --node-rank "
            f"(0 on the machine at --master-addr {self.master_addr}, {others}), or check --master-addr/"
            f"--master-port {self.master_port} (reachable from every machine, not firewalled){said}"
        )


def accelerate_command(
    nproc: int, args: Sequence[str], port: int | None = None, machines: Machines | None = None
) -> list[str]:
    """`accelerate launch` of `nproc` processes (on this machine, of `machines`), each running
    `python -m omni_diffusion_rl.cli ARGS`."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    machines = machines or Machines()
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(nproc * machines.count),  # accelerate: in all; it starts num_processes // num_machines here
    ]
    command += ["--num_machines", str(machines.count), "--mixed_precision", "no", "--dynamo_backend", "no"]
    if machines.count > 1:  # static rendezvous on machine 0, waiting at most the join timeout
        command += ["--machine_rank", str(machines.rank), "--main_process_ip", machines.master_addr]
        command += ["--rdzv_conf", f"timeout={math.ceil(machines.join_timeout_s)}"]
    port = port or machines.master_port or free_port()
    command += ["--main_process_port", str(port), "--module", "omni_diffusion_rl.cli"]
    return [*command, *args]


def launcher_command(
    nproc: int, args: Sequence[str], port: int | None = None, machines: Machines | None = None
) -> list[str]:
    """The launcher of `nproc` processes (on this machine, of `machines`), each running `odrl ARGS`:
    the forking launcher on one machine (on `port`, or a free one it binds itself); on several,
    torch's elastic agent, with its store bound to --master-addr on machine 0 (machine_zero.py) and
    through `accelerate launch` on the others."""
    machines = machines or Machines()
    if machines.count == 1:
        return agent_command(nproc, args, port or 0)
    if machines.rank == 0 and machines.master_port is not None:
        return machine_zero_command(
            nproc, machines.count, machines.master_addr, machines.master_port, machines.join_timeout_s, args
        )
    return accelerate_command(nproc, args, port, machines)


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for launched processes: CPU (gloo) unless a CUDA device is visible or the
    caller chose (ACCELERATE_USE_CPU)."""
    out = dict(os.environ if env is None else env)
    if "ACCELERATE_USE_CPU" not in out:
        import torch

        out["ACCELERATE_USE_CPU"] = "false" if torch.cuda.is_available() else "true"
    return out


def run_launched(
    nproc: int, args: Sequence[str], port: int | None = None, machines: Machines | None = None
) -> int:
    """Run `args` (an odrl command line) in `nproc` processes with output to this terminal; the exit
    code of the launcher (2 when its processes refused the run; on several machines, 1 with a
    sentence when they did not all join). Interrupted, the launcher's whole session is stopped."""
    machines = machines or Machines()
    with tempfile.TemporaryDirectory(prefix="odrl-launch-") as channel:
        env = launch_env()
        env[DECLARED_WORLD_VARIABLE] = str(nproc * machines.count)
        env[LAUNCH_DIR_VARIABLE] = channel
        started = time.monotonic()
        proc = subprocess.Popen(
            launcher_command(nproc, args, port, machines),
            env=env,
            start_new_session=True,
            preexec_fn=parent_death_preexec(),
            stderr=subprocess.PIPE if machines.count > 1 else None,
        )
        relay = _HeldOutput(proc.stderr, lambda: _showing(channel)) if proc.stderr else None
        code, stopped = _wait(proc)
        _stop_leftovers(proc)
        unshown = relay.finish() if relay else b""
        waited_out = not stopped and time.monotonic() - started >= machines.join_timeout_s
        return _outcome(code, unshown, channel, machines, waited_out)


def _outcome(code: int, unshown: bytes, channel: str, machines: Machines, waited_out: bool) -> int:
    """The exit code of `odrl train` for its launcher's `code`, once the launcher's output held back
    (`unshown`) is shown, or replaced by a sentence."""
    if code and machines.count > 1 and waited_out and not marked(channel, STARTED):
        print(machines.join_failure(_last_line(unshown)), file=sys.stderr, flush=True)
        return 1
    taken = PORT_TAKEN in unshown or BIND_FAILED in unshown
    if code and machines.count > 1 and taken and not marked(channel, STARTED):
        print(
            f"odrl: {machines.port_taken('taken by another process as the launcher started')}",
            file=sys.stderr,
        )
        return 2
    if code and marked(channel, REFUSED):  # its sentence, without torch's report of the exits
        _write_stderr(b"".join(line for line in unshown.splitlines(True) if line.startswith(b"odrl:")))
        return 2
    _write_stderr(unshown)
    return code


def _showing(channel: str) -> bool:
    """Whether a launcher's output is shown as it comes: from its processes' start (before, a failed
    rendezvous's traceback is replaced by a sentence) until they refuse the run (then only their
    sentence is shown, not torch's report of their exits)."""
    return marked(channel, STARTED) and not marked(channel, REFUSED)


class _Terminated(Exception):
    """This process got SIGTERM while waiting for its launcher."""


def _raise_terminated(*_: object) -> None:
    raise _Terminated


def _wait(proc: subprocess.Popen[bytes]) -> tuple[int, bool]:
    """The launcher's exit code, and whether this process stopped it: SIGTERM or Ctrl-C of this
    process stops the launcher's session (exit code 143 or 130, as a shell reports those signals).

    The SIGTERM handler only unwinds the wait: the session is stopped after it. Stopped from inside
    the handler, its `proc.wait(timeout)` could never reap the launcher, as the interrupted wait
    still held the lock that reaping takes, so each of its waits ran out (15 s, then 5 s)."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        return proc.wait(), False
    except KeyboardInterrupt:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping already: a second SIGTERM waits
        _stop_session(proc)
        return 130, True
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _stop_session(proc)
        return 128 + signal.SIGTERM, True
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_leftovers(proc: subprocess.Popen[bytes]) -> None:
    """Whatever of the launcher's session outlived it (its processes die with it, see lifeline)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # nothing left
        pass


def _last_line(data: bytes) -> str:
    lines = [line.strip() for line in data.decode(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _write_stderr(data: bytes) -> None:
    if not data:
        return
    sys.stderr.flush()
    binary = getattr(sys.stderr, "buffer", None)  # absent where stderr was replaced (captured)
    if binary is None:
        sys.stderr.write(data.decode(errors="replace"))
        sys.stderr.flush()
    else:
        binary.write(data)
        binary.flush()


class _HeldOutput:
    """A child's output, passed through to this stderr as it comes (progress bars included) while
    `showing()` says so, held back otherwise."""

    def __init__(self, stream: IO[bytes], showing: Callable[[], bool]) -> None:
        self._stream, self._showing = stream, showing
        self._held = bytearray()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._pump, name="odrl-held-stderr", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        fd = self._stream.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            chunk = os.read(fd, 65536) if ready else b""
            if ready and not chunk:  # every writer closed it
                return
            with self._lock:
                self._held += chunk
                if self._held and self._showing():
                    _write_stderr(bytes(self._held))
                    self._held.clear()

    def finish(self, timeout_s: float = 5.0) -> bytes:
        """What was held back and never shown, once the output ended (or after `timeout_s`)."""
        self._thread.join(timeout_s)
        with self._lock:
            held = bytes(self._held)
            self._held.clear()
            self._showing = lambda: True  # what arrives later goes straight through
        return held


PORT_TAKEN = b"but another process is utilizing it"  # accelerate's ConnectionError for a taken port
STOP_SIGNALS = ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0))  # (signal, seconds to wait for the exit)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher's session (torch's agent stops its workers), SIGKILL if it lingers."""
    for sig, wait_s in STOP_SIGNALS:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def without_option(argv: Sequence[str], option: str) -> list[str]:
    """`argv` without `option VALUE` / `option=VALUE` (the launched processes must not launch again)."""
    out, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            out.append(item)
    return out
