"""Point-to-point messages between processes over torch.distributed (gloo), as safetensors bytes.

A message is a length header followed by the bytes on one process group and tag; nothing is
pickled. `pack_group`/`unpack_group` carry one scored prompt group from a rollout process to the
trainer (and a trainer's share of a step, or a lent group) as a NamedBatch (named tensors and texts;
the experience type checks its schema on arrival) with its scores; `pack_weights`/`unpack_weights` carry
the rollout adapter (or a stop) the other way; `pack_lend_request` asks a trainer to make a group.
"""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..named_batch import BatchSchemaError, NamedBatch
from ..reward import ScoreResult
from ..serving.wire import read_metadata

DATA_TAG = 11
WEIGHTS_TAG = 12
SHARE_TAG = 13  # the trainer leader -> another trainer: its share of a step, or a lend request
LENT_TAG = 14  # another trainer -> the leader: the group it made when lent (hybrid)


def send_bytes(data: bytes, dst: int, group: Any, tag: int, timeout_s: float | None = None) -> None:
    """Send `data` to global rank `dst`; with a timeout, a TimeoutError when it is not taken in time."""
    header = torch.tensor([len(data)], dtype=torch.int64)
    body = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else None
    for tensor in (header, body):
        if tensor is not None:
            _wait(
                dist.isend(tensor, dst, group=group, tag=tag), timeout_s, f"rank {dst} did not take a message"
            )


def recv_bytes(src: int | None, group: Any, tag: int, timeout_s: float | None = None) -> tuple[bytes, int]:
    """A whole message and the rank it came from (from any rank when src is None); with a timeout
    (a given `src` only), a TimeoutError when none comes in time."""
    if timeout_s is not None and src is None:
        raise ValueError("a receive with a timeout needs the sender's rank")
    header = torch.zeros(1, dtype=torch.int64)
    if timeout_s is None:
        sender = dist.recv(header, src=src, group=group, tag=tag)
    else:
        _wait(dist.irecv(header, src=src, group=group, tag=tag), timeout_s, f"rank {src} sent no message")
        sender = src
    size = int(header.item())
    if size == 0:
        return b"", sender
    body = torch.empty(size, dtype=torch.uint8)  # the body comes from the header's sender
    _wait(dist.irecv(body, src=sender, group=group, tag=tag), timeout_s, f"rank {sender} sent half a message")
    return body.numpy().tobytes(), sender


def _wait(work: Any, timeout_s: float | None, what: str) -> None:
    """Wait for a send or receive; past `timeout_s`, a TimeoutError saying `what` happened."""
    if timeout_s is None:
        work.wait()
        return
    try:  # gloo raises on timeout (other backends return False)
        done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
    except RuntimeError as e:
        if "imed out" not in str(e):
            raise
        done = False
    if done is False:
        raise TimeoutError(f"{what} within {timeout_s:g} s")


_KINDS = {"sample.": "per_sample", "shared.": "shared"}


EXPERIENCE_PREFIX = "exp."
"""Info keys of a group that carry its rollout process's experience-maker totals (exp.teacher/seconds)."""


def pack_group(
    batch: NamedBatch, scored: ScoreResult, version: int, info: dict[str, float] | None = None
) -> bytes:
    """One scored prompt group made with weights `version`; `info`: the sender's timings."""
    tensors = {
        **{f"sample.{k}": v.detach().cpu().contiguous() for k, v in batch.per_sample.items()},
        **{f"shared.{k}": v.detach().cpu().contiguous() for k, v in batch.shared.items()},
        "score.total": scored.total.contiguous(),
        **{f"part.{k}": v.contiguous() for k, v in scored.parts.items()},
    }
    meta = {
        "texts": json.dumps(batch.texts),
        "failures": json.dumps({str(i): r for i, r in scored.failures.items()}),
        "version": str(version),
        "info": json.dumps(info or {}),
    }
    return save_tensors(tensors, metadata=meta)


def unpack_group(data: bytes) -> tuple[NamedBatch, ScoreResult, int, dict[str, float]]:
    """What pack_group sent; a message whose scores do not cover its samples is refused."""
    meta = read_metadata(data)
    t = load_tensors(data)
    batch = NamedBatch(texts={str(k): list(v) for k, v in json.loads(meta["texts"]).items()})
    for prefix, kind in _KINDS.items():
        getattr(batch, kind).update({k.removeprefix(prefix): v for k, v in t.items() if k.startswith(prefix)})
    failures = {int(i): r for i, r in json.loads(meta["failures"]).items()}
    parts = {k.removeprefix("part."): v for k, v in t.items() if k.startswith("part.")}
    total = t["score.total"]
    if any(len(v) != len(total) for v in parts.values()) or len(total) != len(batch):
        raise BatchSchemaError(f"a group of {len(batch)} samples came with {len(total)} scores")
    info = {str(k): float(v) for k, v in json.loads(meta.get("info", "{}")).items()}
    return batch, ScoreResult(total, parts, failures), int(meta["version"]), info


def pack_lend_request(group_id: int) -> bytes:
    """The trainer leader asks another trainer to make the group at stream position `group_id`."""
    return save_tensors({}, metadata={"lend_group_id": str(group_id)})


def lend_request_of(data: bytes) -> int | None:
    """The group id of a lend request; None for a share (a packed group)."""
    found = read_metadata(data).get("lend_group_id")
    return None if found is None else int(found)


@dataclass
class WeightsMessage:
    """Trainer -> rollout: the rollout adapter at `version` (empty on stop) and where the stream
    stands (`stream_start`: the first position to make, sent once at the start;
    `stream_offset`: see scheduler.may_make_group)."""

    version: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    stop: bool = False
    stream_start: int = 0
    stream_offset: int = 0


def pack_weights(message: WeightsMessage) -> bytes:
    meta = {
        "version": str(message.version),
        "stop": "1" if message.stop else "0",
        "stream_start": str(message.stream_start),
        "stream_offset": str(message.stream_offset),
    }
    return save_tensors({k: v.contiguous() for k, v in message.tensors.items()}, metadata=meta)


def unpack_weights(data: bytes) -> WeightsMessage:
    meta = read_metadata(data)
    return WeightsMessage(
        version=int(meta["version"]),
        tensors=load_tensors(data),
        stop=meta.get("stop") == "1",
        stream_start=int(meta.get("stream_start", 0)),
        stream_offset=int(meta.get("stream_offset", 0)),
    )
