"""Thread budgets (runtime/threads.py): each process's share of the host's cores."""

from __future__ import annotations

import os

import pytest
import torch

from omni_diffusion_rl.runtime.threads import apply_thread_budget, host_cores, thread_share


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
