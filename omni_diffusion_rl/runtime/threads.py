"""Thread budgets: the servers and the race's runs compute on their share of the host's CPUs, so
that processes sharing a host do not oversubscribe it (two teacher servers with torch's default
thread count each ran at 0.07x of one on 2 cores). CPUs are the OS's (the affinity mask): on a host
with SMT that is twice the physical cores torch would take. A container's CPU quota (cgroup v2
`cpu.max`, v1 `cpu.cfs_quota_us`) caps them: a container allowed 2 CPUs of a 64-CPU host has 2.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _small_text(path: Path) -> str | None:
    """The first 256 bytes of a kernel file, None where it cannot be read."""
    try:
        with path.open("rb") as f:
            return f.read(256).decode("ascii", "replace").strip()
    except OSError:
        return None


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> int | None:
    """The CPUs this process's cgroup quota allows, rounded up (at least 1); None without a quota or
    where none can be read (v2 `cpu.max` "QUOTA PERIOD" or "max PERIOD"; v1 `cpu.cfs_quota_us`, -1
    for none, over `cpu.cfs_period_us`)."""
    v2 = _small_text(root / "cpu.max")
    if v2 is not None:
        fields = v2.split()
        quota, period = (fields + ["", ""])[:2]
    else:
        v1 = root / "cpu"
        quota, period = (
            _small_text(v1 / "cpu.cfs_quota_us") or "",
            _small_text(v1 / "cpu.cfs_period_us") or "",
        )
    if not (quota.isdigit() and period.isdigit()) or int(period) == 0:
        return None  # "max", -1, or nothing readable: no quota
    return max(1, math.ceil(int(quota) / int(period)))


def host_cores(cgroup_root: Path = CGROUP_ROOT) -> int:
    """The cores this process may run on: its CPU affinity where the OS tells it, capped by its
    cgroup's CPU quota; at least 1."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit(cgroup_root)
    return max(1, cores if limit is None else min(cores, limit))


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
