"""One launcher for several training processes: `odrl train --nproc N` and the benchmarks.

Builds the `accelerate launch` command line once (module entry point of the installed package, so no
recipes folder is needed; on a machine without CUDA the processes run on CPU over gloo) and runs
it in a session of its own that dies with the caller; Ctrl-C or SIGTERM of the caller stops the
launcher and every process it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping, Sequence

from .lifeline import parent_death_preexec


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def accelerate_command(nproc: int, args: Sequence[str], port: int | None = None) -> list[str]:
    """`accelerate launch` of `nproc` processes, each running `python -m omni_diffusion_rl.cli ARGS`."""
    if nproc < 1:
        raise ValueError(f"nproc must be at least 1, got {nproc}")
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        str(nproc),
    ]
    command += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command += ["--main_process_port", str(port or free_port()), "--module", "omni_diffusion_rl.cli"]
    return [*command, *args]


def launch_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment for launched processes: CPU (gloo) unless a CUDA device is visible or the
    caller chose (ACCELERATE_USE_CPU)."""
    out = dict(os.environ if env is None else env)
    if "ACCELERATE_USE_CPU" not in out:
        import torch

        out["ACCELERATE_USE_CPU"] = "false" if torch.cuda.is_available() else "true"
    return out


def run_launched(nproc: int, args: Sequence[str], port: int | None = None) -> int:
    """Run `args` (an odrl command line) in `nproc` processes with output to this terminal; the exit
    code of the launcher. Interrupted, the launcher's whole session is stopped."""
    proc = subprocess.Popen(
        accelerate_command(nproc, args, port),
        env=launch_env(),
        start_new_session=True,
        preexec_fn=parent_death_preexec(),
    )
    previous = signal.signal(signal.SIGTERM, lambda *_: _stop_session(proc))
    try:
        return proc.wait()
    except KeyboardInterrupt:
        _stop_session(proc)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_session(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the launcher's session (torch's agent stops its workers), SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 5.0)):
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
