"""Collectives over a process group (the whole world, or the trainer processes of an async mode),
with tensors placed where the backend needs them (nccl: the process's GPU) and put back after."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def collective_device(device: torch.device | None, group: Any = None) -> torch.device:
    """Where a tensor for a collective on `group` must live (nccl: the GPU)."""
    nccl = is_distributed() and "nccl" in str(dist.get_backend(group))
    return device if nccl and device is not None and device.type == "cuda" else torch.device("cpu")


def all_reduce_sum(t: torch.Tensor, group: Any = None, device: torch.device | None = None) -> torch.Tensor:
    """The sum of `t` over the group's processes (a new tensor on `t`'s device)."""
    moved = t.to(collective_device(device, group))
    moved = moved.clone() if moved is t else moved
    dist.all_reduce(moved, group=group)
    return moved.to(t.device)


def all_gather_cat(t: torch.Tensor, group: Any = None, device: torch.device | None = None) -> torch.Tensor:
    """Every process's `t` concatenated along dim 0 in rank order; lengths may differ."""
    on = collective_device(device, group)
    world = dist.get_world_size(group)
    local = t.to(on)
    if local.dtype == torch.bool:  # not every backend reduces or gathers bool
        local = local.to(torch.uint8)
    size = torch.tensor([local.shape[0]], dtype=torch.long, device=on)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    padded = torch.zeros((longest, *local.shape[1:]), dtype=local.dtype, device=on)
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    out = torch.cat([part[: int(n)] for part, n in zip(parts, sizes, strict=True)])
    return out.to(device=t.device, dtype=t.dtype)


class PeerDataError(RuntimeError):
    """What a peer process sent through a collective is not what the protocol allows."""


GATHER_JSON_MAX_BYTES = 1 << 20  # a process's JSON value in all_gather_json: layouts, configs, names


def all_gather_json(
    value: Any,
    group: Any = None,
    device: torch.device | None = None,
    max_bytes: int = GATHER_JSON_MAX_BYTES,
) -> list[Any]:
    """Every process's JSON value (dicts, lists, strings, numbers, booleans, None) in rank order
    (tuples come back as lists).

    Unlike `dist.all_gather_object`, nothing a peer sends is unpickled: each process sends its
    length, then UTF-8 JSON bytes; a length over `max_bytes` is refused before anything is
    allocated for it, and bytes that are not strict JSON are a PeerDataError naming the rank."""
    data = json.dumps(value, separators=(",", ":")).encode("utf-8")
    if len(data) > max_bytes:
        raise ValueError(f"a value of {len(data)} bytes exceeds all_gather_json's limit of {max_bytes}")
    on = collective_device(device, group)
    world = dist.get_world_size(group)
    size = torch.tensor([len(data)], dtype=torch.int64, device=on)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    lengths = [int(s) for s in sizes]
    for rank, length in enumerate(lengths):
        if not 0 < length <= max_bytes:
            raise PeerDataError(
                f"process {rank} of the group announced {length} bytes of JSON (allowed: 1 to {max_bytes}); "
                "every machine must run the same omni-diffusion-rl"
            )
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8, device=on)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    return [
        _peer_json(part[:n].cpu().numpy().tobytes(), rank)
        for rank, (part, n) in enumerate(zip(parts, lengths, strict=True))
    ]


def _peer_json(data: bytes, rank: int) -> Any:
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise PeerDataError(
            f"process {rank} of the group sent bytes that are not UTF-8 JSON ({type(e).__name__}: {e}); "
            "every machine must run the same omni-diffusion-rl"
        ) from None


def broadcast_ints(values: list[int], group: Any = None, device: torch.device | None = None) -> list[int]:
    """Global rank 0's `values` on every process of `group`."""
    t = torch.tensor(values, dtype=torch.int64, device=collective_device(device, group))
    dist.broadcast(t, src=0, group=group)
    return [int(v) for v in t.tolist()]


def mean_over_processes(values: list[float], device: torch.device | None = None) -> list[float]:
    """Each value averaged over every process (the values themselves when not distributed)."""
    if not is_distributed() or dist.get_world_size() == 1:
        return list(values)
    total = all_reduce_sum(torch.tensor(values, dtype=torch.float64), device=device)
    return (total / dist.get_world_size()).tolist()


@contextlib.contextmanager
def scoped_groups(specs: list[tuple[list[int], str | None]]) -> Iterator[list[Any]]:
    """Process groups (ranks, backend) for one part of a run, destroyed when it ends: a run that
    switches modes would otherwise keep every old mode's sockets and communicators. Every process
    creates them in the same order; at a normal end all wait for each other on the first group
    (every rank, gloo) before destroying, so no group goes away under a peer still using it. After
    an error, here or on a peer (whose exit breaks the barrier), they are left to the process's
    exit: the peer's own error says what went wrong."""
    groups = [dist.new_group(ranks, backend=backend) for ranks, backend in specs]
    yield groups
    try:
        dist.barrier(group=groups[0])
    except RuntimeError:  # a peer failed and is gone
        return
    for group in groups:
        dist.destroy_process_group(group)  # a no-op on processes outside the group
