"""Every test runs offline: no hub downloads, wandb writes local runs only.

The fast tier (`make test-fast`, `-m "not slow"`) is guarded here: a test that is not marked `slow`
fails when it (or a fixture it sets up) starts a process (subprocess, multiprocessing or
torch.multiprocessing) or takes more than FAST_TIER_OPTIMIZER_STEPS optimizer steps, so the tier
means what the Makefile says. A module-scoped fixture is charged to the test that first sets it up.
"""

from __future__ import annotations

import json
import multiprocessing.process
import os
import resource
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from omni_diffusion_rl.runtime.threads import thread_share

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):  # each xdist worker takes its share of the cores
    torch.set_num_threads(thread_share(int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

FAST_TIER_OPTIMIZER_STEPS = 8  # a handful: a few training steps of one run

# A suite started in the background by a non-interactive shell (`make test &` in a script) inherits an
# ignored SIGINT, and so would every server and launcher it starts: the Ctrl-C tests would find them
# deaf to it. Give this process Python's own handler back, so its children start with the default.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _build_font_cache() -> None:
    """matplotlib lists the machine's fonts (it runs fc-list) the first time it is imported on a
    machine: do it here, before the guard, not inside whichever fast test draws a chart first."""
    try:
        import matplotlib.font_manager  # noqa: F401
    except ImportError:  # drawing is optional: nothing to build
        return


_build_font_cache()


class _TierGuard:
    """What the test being run has started so far, and whether it may."""

    def __init__(self) -> None:
        self.item: pytest.Item | None = None
        self.problems: list[str] = []
        self.optimizer_steps = 0

    def reset(self, item: pytest.Item | None) -> None:
        self.item, self.problems, self.optimizer_steps = item, [], 0

    @property
    def fast(self) -> bool:
        return self.item is not None and self.item.get_closest_marker("slow") is None

    def note_process(self, what: str) -> None:
        if self.fast:
            self.problems.append(f"starts a process ({what})")

    def note_optimizer_step(self) -> None:
        self.optimizer_steps += 1
        if self.fast and self.optimizer_steps == FAST_TIER_OPTIMIZER_STEPS + 1:
            self.problems.append(f"takes more than {FAST_TIER_OPTIMIZER_STEPS} optimizer steps")


GUARD = _TierGuard()


def _install_tier_guard() -> None:
    popen_init = subprocess.Popen.__init__
    process_start = multiprocessing.process.BaseProcess.start

    def guarded_popen_init(self: subprocess.Popen, args: Any, *rest: Any, **kwargs: Any) -> None:
        GUARD.note_process(f"subprocess: {str(args)[:120]}")
        if os.environ.get("ODRL_PROC_LOG") and GUARD.item is not None and kwargs.get("env") is not None:
            # the process census names the test that started a process: an env the test built
            # before the test began (helpers.ENV) would name none
            kwargs["env"] = {"PYTEST_CURRENT_TEST": GUARD.item.nodeid, **kwargs["env"]}
        popen_init(self, args, *rest, **kwargs)

    def guarded_process_start(self: multiprocessing.process.BaseProcess) -> None:
        GUARD.note_process(f"multiprocessing: {self.name}")
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen_init  # type: ignore[method-assign]
    multiprocessing.process.BaseProcess.start = guarded_process_start  # type: ignore[method-assign]
    register_optimizer_step_pre_hook(lambda *_: GUARD.note_optimizer_step())


_install_tier_guard()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    GUARD.reset(item)
    before = _cpu_now() if CPU_LOG else None
    yield
    GUARD.reset(None)
    if before is not None:
        _log_cpu(item.nodeid, before, _cpu_now())


# Where the suite's CPU goes, per test: with ODRL_TEST_CPU_LOG=FILE each test appends a JSON line of
# its wall seconds, this process's CPU seconds and its children's (every process it started and
# reaped, with their own reaped children; a server killed by a signal counts once reaped). Setup and
# teardown are included: a module fixture is charged to the test that first sets it up.
CPU_LOG = os.environ.get("ODRL_TEST_CPU_LOG")


def _cpu_now() -> tuple[float, float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        time.monotonic(),
        own.ru_utime + own.ru_stime,
        children.ru_utime + children.ru_stime,
    )


def _log_cpu(nodeid: str, before: tuple[float, float, float], after: tuple[float, float, float]) -> None:
    wall, own, children = (round(b - a, 2) for a, b in zip(before, after, strict=True))
    line = {"test": nodeid, "wall_s": wall, "cpu_s": own, "children_cpu_s": children}
    with open(str(CPU_LOG), "a", encoding="utf-8") as f:
        f.write(json.dumps(line) + "\n")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A fast-tier test that broke the guard's rules fails in its call phase, whatever it asserted."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and GUARD.problems and not report.failed:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} is not marked slow but {'; '.join(dict.fromkeys(GUARD.problems))}: "
            "mark it @pytest.mark.slow (the fast tier is for in-process tests of a few steps)"
        )


@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Tiny models run fastest single-threaded (thread wake-ups dominate on a busy CPU); modules opt
    in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
