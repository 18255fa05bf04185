"""Thread budgets: the servers and the race's runs compute on their share of the host's CPUs, so
that processes sharing a host do not oversubscribe it (two teacher servers with torch's default
thread count each ran at 0.07x of one on 2 cores). CPUs are the OS's (the affinity mask): on a host
with SMT that is twice the physical cores torch would take."""

from __future__ import annotations

import os


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells it), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def thread_share(sharers: int, cores: int | None = None) -> int:
    """Threads for each of `sharers` processes computing at once on `cores` (default: this host's)."""
    if sharers < 1:
        raise ValueError(f"the processes sharing the host must be at least 1, got {sharers}")
    return max(1, (cores if cores is not None else host_cores()) // sharers)


def apply_thread_budget(threads: int) -> int:
    """Make this process compute on `threads` threads (torch's intra-op pool, and OpenMP in any child
    it starts); returns the count torch now uses."""
    import torch

    if threads < 1:
        raise ValueError(f"a thread budget must be at least 1, got {threads}")
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return torch.get_num_threads()
