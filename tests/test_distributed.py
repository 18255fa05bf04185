"""Collective helpers over real gloo process groups in two spawned processes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_diffusion_rl.runtime.distributed import mean_over_processes, scoped_groups


def _use_and_release_groups(rank: int, init_file: str, result_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        before = len(dist.distributed_c10d._world.pg_map)
        mean = mean_over_processes([float(rank), 10.0 * rank])
        for _ in range(3):  # as a run switching modes three times
            with scoped_groups([([0, 1], "gloo"), ([0], "gloo")]) as (both, only_first):
                t = torch.tensor([rank + 1.0])
                dist.all_reduce(t, group=both)
                if rank == 0:
                    dist.all_reduce(torch.ones(1), group=only_first)
            inside = len(dist.distributed_c10d._world.pg_map)
        Path(f"{result_file}.{rank}").write_text(
            json.dumps({"mean": mean, "sum": t.item(), "before": before, "after": inside})
        )
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_scoped_groups_are_destroyed_on_every_process_and_means_agree(tmp_path: Path) -> None:
    result = tmp_path / "result"
    mp.start_processes(
        _use_and_release_groups, args=(str(tmp_path / "init"), str(result)), nprocs=2, start_method="spawn"
    )
    for rank in (0, 1):
        out = json.loads(Path(f"{result}.{rank}").read_text())
        assert out["mean"] == [0.5, 5.0]
        assert out["sum"] == 3.0
        assert out["after"] == out["before"], "groups of ended parts must not pile up"
