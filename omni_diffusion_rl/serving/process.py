"""Start `odrl serve-reward` or `odrl serve-teacher` as a child process and wait until it listens
(benchmarks, tests, scripts)."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

from ..runtime.lifeline import parent_death_preexec


class ServerProcess:
    """A server child process; `url` is known once it printed its ready line. Use as a context."""

    def __init__(
        self,
        names: list[str],
        *extra_args: str,
        port: int = 0,
        env: dict[str, str] | None = None,
        ready_timeout_s: float = 120.0,
        cwd: str | Path | None = None,
        command: str = "serve-reward",
    ) -> None:
        """names: what `command` (serve-reward, or serve-teacher with one name) serves."""
        command_line = [sys.executable, "-m", "omni_diffusion_rl.cli", command, *names, "--port", str(port)]
        self.command = [*command_line, *extra_args]
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.cwd = cwd
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.ready: dict[str, object] = {}  # the ready line: url, what it serves, its threads
        self.output: list[str] = []

    def start(self) -> ServerProcess:
        """Start the server and wait for its ready line. Started from the main thread, the server
        dies with this process even when it is SIGKILLed (Linux's parent-death signal, which fires
        when the starting thread ends: from another thread it is not armed)."""
        self.proc = subprocess.Popen(
            self.command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
            cwd=self.cwd,
            preexec_fn=parent_death_preexec(),  # noqa: PLW1509 - one prctl call, main thread only
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(self.proc.stdout, lines, self.output), daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if line is None:
                raise RuntimeError(
                    f"{self.command[3]} exited with {self.proc.wait()}:\n{''.join(self.output)[-3000:]}"
                )
            if line.startswith('{"event": "ready"'):
                self.ready = json.loads(line)
                self.url = str(self.ready["url"])
                return self
        self.stop()
        raise TimeoutError(
            f"{self.command[3]} not ready within {self.ready_timeout_s} s:\n{''.join(self.output)[-3000:]}"
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def __enter__(self) -> ServerProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _pump(stream: IO[str] | None, lines: queue.Queue[str | None], keep: list[str]) -> None:
    if stream is None:
        return
    for line in stream:
        keep.append(line)
        lines.put(line)
    lines.put(None)
