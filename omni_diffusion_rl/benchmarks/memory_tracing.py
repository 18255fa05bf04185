"""What every memory trace shares: a fake process group of N ranks, one traced step under torch's
FSDPMemTracker, a MemTracker that counts a module called many times in one pass, and the CPU peak of a
tracker's snapshot. The traces themselves: memory_trace.py (H3), memory_trace_ltx2.py,
memory_trace_qwen.py, memory_trace_rewards.py; memory_trace_check.py checks them on real tensors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any

import torch
from torch.distributed._tools.mem_tracker import MemTracker

GIB = 2**30
SEED_RANKS = 8
CUDA_MAX_ALLOCATED = "CUDA max allocated"
"""The key under which a step run on a GPU reports torch.cuda.max_memory_allocated."""


@contextlib.contextmanager
def fake_process_group(ranks: int, who: str, rank: int = 0) -> Iterator[None]:
    """A fake process group of `ranks` ranks (this process is `rank`) for the block, destroyed after."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError(f"{who} runs its own (fake) process group: call it outside a run")
    dist.init_process_group("fake", rank=rank, world_size=ranks, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def traced_step(
    model: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    forward: Callable[[], Sequence[torch.Tensor]],
    train: bool,
    device: str = "cpu",
) -> dict[Any, int]:
    """FSDPMemTracker's peak (bytes by category on `device`'s type) over `forward()` and, with
    `train`, the backward of a stand-in loss (the mean square of every output) and an AdamW step on
    the trainable parameters; run where `model` is placed (under a FakeTensorMode for a trace). On a
    CUDA device it adds CUDA_MAX_ALLOCATED: the caching allocator's own peak over the same step,
    everything already on the device included (the weights), to check the tracker against."""
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

    from ..models.lora import trainable_parameters

    cuda = torch.device(device).type == "cuda"
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=1e-4) if train else None
    tracker = FSDPMemTracker(model, optimizer)
    tracker.track_inputs(tuple(inputs))
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with tracker, torch.set_grad_enabled(train):
        outputs = forward()
        if optimizer is not None:
            sum(out.float().square().mean() for out in outputs).backward()
            optimizer.step()
    peak = peak_on(tracker.get_tracker_snapshot("peak"), torch.device(device).type)
    if cuda:
        torch.cuda.synchronize(device)
        peak[CUDA_MAX_ALLOCATED] = torch.cuda.max_memory_allocated(device)
    return peak


def step_report(
    case: Any, fake: bool, train: bool, model: torch.nn.Module, peak: dict[Any, int]
) -> dict[str, Any]:
    return {
        "case": asdict(case),
        "fake_tensors": fake,
        "train": train,
        "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,  # whole (DTensor numel)
        "adapter_parameters_b": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) / 1e9,
        "peak_gib": {str(k): v / GIB for k, v in peak.items()},
    }


class WholeCallTracker(MemTracker):
    """torch's MemTracker without its statistics per module, which refuse a module called twice in
    one pass (the VAE's decoder runs once per tile); every tensor is counted as before (the weights
    through track_external, everything the decode makes as activations)."""

    def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
        pass

    def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        pass


def peak_on(peak: dict[Any, dict[Any, int]], device_type: str = "cpu") -> dict[Any, int]:
    """The tracker's peak snapshot for the device of `device_type` (the CPU, where the fake ranks
    compute, unless a real run is checked on a GPU)."""
    for device, categories in peak.items():
        if torch.device(device).type == device_type:
            return {getattr(k, "value", k): v for k, v in categories.items()}
    raise RuntimeError(f"the tracker saw no {device_type} memory: {list(peak)}")


def check_trace_device(fake: bool, device: str) -> str:
    """`device` for a step: a trace (fake tensors) runs on the CPU; a real run anywhere."""
    if fake and torch.device(device).type != "cpu":
        raise ValueError(
            f"a trace (fake=True) runs on the CPU; device={device!r} is for real runs (fake=False)"
        )
    return device
