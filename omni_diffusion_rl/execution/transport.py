"""Point-to-point messages between processes over torch.distributed (gloo), as safetensors bytes.

A message is a length header followed by the bytes on one process group and tag; nothing is
pickled. `pack_group`/`unpack_group` carry one scored prompt group from a rollout process to the
trainer; `pack_weights`/`unpack_weights` carry the rollout adapter (or a stop) the other way.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..reward import ScoreResult
from ..rollout import Rollout
from ..serving.wire import read_metadata

DATA_TAG = 11
WEIGHTS_TAG = 12


def send_bytes(data: bytes, dst: int, group: Any, tag: int, timeout_s: float | None = None) -> None:
    """Send `data` to global rank `dst`; with a timeout, a TimeoutError when it is not taken in time."""
    header = torch.tensor([len(data)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    for tensor in (header, body):
        if tensor is None:
            continue
        work = dist.isend(tensor, dst, group=group, tag=tag)
        if timeout_s is None:
            work.wait()
            continue
        try:  # gloo raises on timeout (other backends return False)
            delivered = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        except RuntimeError as e:
            if "imed out" not in str(e):
                raise
            delivered = False
        if delivered is False:
            raise TimeoutError(f"rank {dst} did not take a message within {timeout_s:g} s")


def recv_bytes(src: int | None, group: Any, tag: int) -> tuple[bytes, int]:
    """A whole message and the rank it came from (blocking; from any rank when src is None)."""
    header = torch.zeros(1, dtype=torch.int64)
    sender = dist.recv(header, src=src, group=group, tag=tag)
    size = int(header.item())
    if size == 0:
        return b"", sender
    body = torch.empty(size, dtype=torch.uint8)
    dist.recv(body, src=sender, group=group, tag=tag)  # the body comes from the header's sender
    return body.numpy().tobytes(), sender


def pack_group(rollout: Rollout, scored: ScoreResult, version: int) -> bytes:
    tensors = {
        "x0": rollout.x0.detach().cpu().contiguous(),
        "group_ids": rollout.group_ids.cpu(),
        "grid": rollout.grid.cpu(),
        "total": scored.total,
        **{f"cond.{k}": v.detach().cpu().contiguous() for k, v in rollout.cond.items()},
        **{f"part.{k}": v for k, v in scored.parts.items()},
    }
    meta = {
        "prompts": json.dumps(rollout.prompts),
        "failures": json.dumps({str(i): r for i, r in scored.failures.items()}),
        "version": str(version),
    }
    return save_tensors(tensors, metadata=meta)


def unpack_group(data: bytes) -> tuple[Rollout, ScoreResult, int]:
    meta = read_metadata(data)
    t = load_tensors(data)
    rollout = Rollout(
        prompts=json.loads(meta["prompts"]),
        group_ids=t["group_ids"],
        x0=t["x0"],
        cond={k.removeprefix("cond."): v for k, v in t.items() if k.startswith("cond.")},
        grid=t["grid"],
    )
    failures = {int(i): r for i, r in json.loads(meta["failures"]).items()}
    parts = {k.removeprefix("part."): v for k, v in t.items() if k.startswith("part.")}
    return rollout, ScoreResult(t["total"], parts, failures), int(meta["version"])


def pack_weights(tensors: dict[str, torch.Tensor], version: int, stop: bool = False) -> bytes:
    meta = {"version": str(version), "stop": "1" if stop else "0"}
    return save_tensors({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def unpack_weights(data: bytes) -> tuple[dict[str, torch.Tensor], int, bool]:
    meta = read_metadata(data)
    return load_tensors(data), int(meta["version"]), meta.get("stop") == "1"
