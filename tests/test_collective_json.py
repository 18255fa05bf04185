"""all_gather_json: what peer processes send is read as length-checked UTF-8 JSON, never unpickled.

Two real gloo processes on 127.0.0.1. Process 1 plays a hostile peer: it speaks the wire protocol by
hand (a length, then bytes) and sends a pickle that would create a file when unpickled, a length of
a terabyte, or valid JSON; process 0 runs the real all_gather_json and reports what it got."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from omni_diffusion_rl.runtime.distributed import GATHER_JSON_MAX_BYTES, PeerDataError, all_gather_json
from omni_diffusion_rl.runtime.launch import free_port

pytestmark = pytest.mark.slow  # starts processes


class _CreatesAFile:
    """Unpickling this runs `open(path, "w")`: the proof that a receiver unpickled peer data."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return (open, (self.path, "w"))


def _send_raw(data: bytes, announced: int) -> None:
    """What a hostile peer does: announce `announced` bytes, then send `data` padded like the others."""
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(2)]
    dist.all_gather(sizes, torch.tensor([announced], dtype=torch.int64))
    if any(not 0 < int(s) <= GATHER_JSON_MAX_BYTES for s in sizes):
        return  # the honest process refuses before the second collective
    longest = max(int(s) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.all_gather([torch.empty_like(padded) for _ in range(2)], padded)


def _process(rank: int, port: int, case: str, folder: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        if rank == 1:
            if case == "pickle":
                payload = pickle.dumps(_CreatesAFile(str(Path(folder) / "unpickled")))
                _send_raw(payload, len(payload))
            elif case == "huge":
                _send_raw(b"", 1 << 40)
            else:
                all_gather_json({"names": ["a", "b"], "rank": 1})
            return
        try:
            outcome = {"values": all_gather_json({"names": ["c"], "rank": 0})}
        except PeerDataError as e:
            outcome = {"error": str(e)}
        (Path(folder) / "outcome.json").write_text(json.dumps(outcome))
    finally:
        dist.destroy_process_group()


def _run(case: str, folder: Path) -> dict:
    mp.start_processes(_process, args=(free_port(), case, str(folder)), nprocs=2, start_method="spawn")
    return json.loads((folder / "outcome.json").read_text())


def test_peers_values_arrive_as_json_in_rank_order(tmp_path: Path) -> None:
    outcome = _run("json", tmp_path)
    assert outcome == {"values": [{"names": ["c"], "rank": 0}, {"names": ["a", "b"], "rank": 1}]}


def test_a_pickle_from_a_peer_is_refused_and_never_unpickled(tmp_path: Path) -> None:
    outcome = _run("pickle", tmp_path)
    assert "process 1 of the group sent bytes that are not UTF-8 JSON" in outcome.get("error", ""), outcome
    assert not (tmp_path / "unpickled").exists(), "the peer's pickle ran code here"


def test_a_length_past_the_limit_is_refused_before_anything_is_allocated(tmp_path: Path) -> None:
    outcome = _run("huge", tmp_path)
    assert f"process 1 of the group announced {1 << 40} bytes" in outcome.get("error", ""), outcome
