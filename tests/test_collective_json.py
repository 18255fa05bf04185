"""all_gather_json: what peer processes send is read as length-checked UTF-8 JSON, never unpickled.

Two real gloo processes on 127.0.0.1. Process 1 plays a hostile peer: it speaks the wire protocol by
hand (a length, then bytes) and sends a pickle that would create a file when unpickled, a length of
a terabyte, or valid JSON; process 0 (this test process) runs the real all_gather_json and reports
what it got. The pair plays every case in turn (each leaves both processes at the same collective),
and each test reads its case's outcome."""

from __future__ import annotations

import json
import pickle
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from omni_diffusion_rl.runtime.distributed import GATHER_JSON_MAX_BYTES, PeerDataError, all_gather_json
from omni_diffusion_rl.runtime.launch import free_port
from omni_diffusion_rl.runtime.run_secret import RunSecretError, prove_secret

from .helpers import with_a_spawned_peer

pytestmark = pytest.mark.slow  # starts a process

CASES = ("json", "pickle", "huge")
# (process 0's secret, process 1's, machine 0's address) of each run-secret case
SECRETS = {
    "secret: the same": (b"s" * 20, b"s" * 20, "10.0.0.1"),
    "secret: another on process 1": (b"s" * 20, b"t" * 20, "10.0.0.1"),
    "secret: none on process 1": (b"s" * 20, None, "10.0.0.1"),
    "secret: none, machine 0 elsewhere": (None, None, "10.0.0.1"),
    "secret: none, loopback": (None, None, "127.0.0.1"),
}


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


def _play(rank: int, case: str, folder: Path) -> None:
    """One case on both processes: process 1 sends, process 0 writes `folder`/outcome.json."""
    if case in SECRETS:
        *secrets, address = SECRETS[case]
        try:
            prove_secret(secrets[rank], address, machines=2)
            outcome = {"proved": True}
        except RunSecretError as e:
            outcome = {"error": str(e)}
        (folder / f"outcome_{rank}.json").write_text(json.dumps(outcome))
        return
    if rank == 1:
        if case == "pickle":
            payload = pickle.dumps(_CreatesAFile(str(folder / "unpickled")))
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
    (folder / "outcome.json").write_text(json.dumps(outcome))


def _process(rank: int, port: int, root: str) -> None:
    timeout = timedelta(seconds=300)  # a collective whose peer is gone fails (a hang stop, no verdict)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", timeout=timeout, rank=rank, world_size=2
    )
    try:
        for case in (*CASES, *SECRETS):
            _play(rank, case, Path(root) / case)
            dist.barrier()  # the next case starts once both processes are done with this one
    finally:
        dist.destroy_process_group()


def _hostile_peer(_index: int, port: int, root: str) -> None:
    """Process 1, in a process of its own."""
    _process(1, port, root)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, Path]]:
    """Each case's outcome on process 0, and the folder it was played in."""
    root = tmp_path_factory.mktemp("collective_json")
    for case in (*CASES, *SECRETS):
        (root / case).mkdir()
    args = (free_port(), str(root))
    with_a_spawned_peer(_hostile_peer, args, lambda: _process(0, *args))
    outcomes = {case: (json.loads((root / case / "outcome.json").read_text()), root / case) for case in CASES}
    for case in SECRETS:  # both processes' outcomes
        outcomes[case] = (
            {r: json.loads((root / case / f"outcome_{r}.json").read_text()) for r in (0, 1)},
            root,
        )
    return outcomes


def test_peers_values_arrive_as_json_in_rank_order(outcomes: dict[str, tuple[dict, Path]]) -> None:
    outcome, _ = outcomes["json"]
    assert outcome == {"values": [{"names": ["c"], "rank": 0}, {"names": ["a", "b"], "rank": 1}]}


def test_a_pickle_from_a_peer_is_refused_and_never_unpickled(outcomes: dict[str, tuple[dict, Path]]) -> None:
    outcome, folder = outcomes["pickle"]
    assert "process 1 of the group sent bytes that are not UTF-8 JSON" in outcome.get("error", ""), outcome
    assert not (folder / "unpickled").exists(), "the peer's pickle ran code here"


def test_a_length_past_the_limit_is_refused_before_anything_is_allocated(
    outcomes: dict[str, tuple[dict, Path]],
) -> None:
    outcome, _ = outcomes["huge"]
    assert f"process 1 of the group announced {1 << 40} bytes" in outcome.get("error", ""), outcome


SECRET_OUTCOMES = {  # case -> what both processes say (None: both proved it)
    "secret: the same": None,
    "secret: another on process 1": "process(es) OTHER did not prove this machine's secret",
    "secret: none on process 1": "process(es) 1 of the run hold no secret while others do",
    "secret: none, machine 0 elsewhere": "machine 0 at --master-addr 10.0.0.1 needs a shared secret",
    "secret: none, loopback": None,
}


@pytest.mark.parametrize("case", list(SECRETS))
def test_every_process_proves_the_runs_secret_before_anything_else(
    outcomes: dict[str, tuple[dict, Path]], case: str
) -> None:
    """A peer with another secret, or none, is refused by both processes alike (each names the
    other); a run without any secret is refused unless machine 0 is a loopback address."""
    both, _ = outcomes[case]
    expected = SECRET_OUTCOMES[case]
    for rank in (0, 1):
        if expected is None:
            assert both[rank] == {"proved": True}, both
        else:
            said = expected.replace("OTHER", str(1 - rank))
            assert said in both[rank].get("error", "") and "ODRL_RUN_SECRET" in both[rank]["error"], both
