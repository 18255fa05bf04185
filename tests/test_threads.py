"""Thread budgets (runtime/threads.py): each process's share of the host's cores."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.runtime.threads import apply_thread_budget, cgroup_cpu_limit, host_cores, thread_share


def test_each_sharer_gets_an_equal_share_and_at_least_one() -> None:
    assert [thread_share(n, cores=16) for n in (1, 2, 3, 16, 64)] == [16, 8, 5, 1, 1]
    assert thread_share(1) == host_cores() >= 1
    with pytest.raises(ValueError, match="at least 1, got 0"):
        thread_share(0)


def test_a_budget_sets_torchs_threads_and_openmps_for_children(monkeypatch: pytest.MonkeyPatch) -> None:
    before = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "7")  # restored after the test
    try:
        assert apply_thread_budget(1) == torch.get_num_threads() == 1
        assert os.environ["OMP_NUM_THREADS"] == "1"
        with pytest.raises(ValueError, match="at least 1, got 0"):
            apply_thread_budget(0)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("files", "limit"),
    [
        ({"cpu.max": "200000 100000\n"}, 2),
        ({"cpu.max": "150000 100000"}, 2),  # 1.5 CPUs: rounded up
        ({"cpu.max": "5000 100000"}, 1),
        ({"cpu.max": "max 100000"}, None),
        ({"cpu.max": "garbage"}, None),
        ({"cpu.max": "100 0"}, None),
        ({"cpu/cpu.cfs_quota_us": "400000", "cpu/cpu.cfs_period_us": "100000"}, 4),
        ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, None),
        ({}, None),
    ],
)
def test_a_containers_cpu_quota_caps_the_host_cores(
    tmp_path: Path, files: dict[str, str], limit: int | None
) -> None:
    """A container allowed 2 CPUs of a bigger host gets budgets for 2 (two servers at the host's
    count each oversubscribed 2 cores to 0.07x of one)."""
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_limit(tmp_path) == limit
    assert host_cores(tmp_path) == min(host_cores(tmp_path / "none"), limit or 10**6)
