"""The tracer checked against real tensors: each family's training micro-step and forward without
gradients at two small sizes, over 1 and 2 fake ranks, traced on fake tensors and run on real CPU
tensors under the same tracker. A table and JSON:

    python -m omni_diffusion_rl.benchmarks.memory_trace_check

The families are the built-in tiny_av model, LTX-2 (the tiny random-init pipeline at two clip
sizes) and MiniMax-H3 (two small transformer widths and clip sizes). Each real run counts bytes
that exist; the trace counts shapes only. `odrl bench memory --trace` trusts the trace at full size
because the two agree here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from .memory_trace import TINY_CASE, TraceCase, trace_update
from .memory_trace_ltx2 import TINY_LTX2, Ltx2Case, trace_ltx2_update
from .memory_tracing import (
    CUDA_MAX_ALLOCATED,
    GIB,
    check_trace_device,
    fake_process_group,
    step_report,
    traced_step,
)


@dataclass(frozen=True)
class TinyAvCase:
    """The built-in tiny_av transformer at a width and depth, a batch of samples, LoRA on its
    default targets, sharded over `ranks` ranks (fp32, as the tiny model trains)."""

    name: str = "tiny_av"
    ranks: int = 2
    dim: int = 96
    depth: int = 4
    heads: int = 4
    batch: int = 8
    lora_rank: int = 8
    gradient_checkpointing: bool = False


def trace_tiny_av_update(
    case: TinyAvCase, fake: bool = True, train: bool = True, device: str = "cpu"
) -> dict[str, Any]:
    """Peak bytes of rank 0 over one tiny_av micro-step of `case.batch` samples through
    TinyAVPolicy.velocity (or, `train=False`, a forward without gradients), sharded over
    `case.ranks` fake ranks with the project's FSDP2 code (FSDPMemTracker's categories, GiB);
    `device`: where a real run computes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.lora import add_nft_adapters
    from ..models.tiny_av import DEFAULT_LORA_TARGETS, TinyAVPolicy, TinyAVTransformer
    from ..runtime.sharding import process_group_mesh, shard_module, shard_units

    device = check_trace_device(fake, device)
    with fake_process_group(case.ranks, "trace_tiny_av_update"):
        with torch.device("meta"):
            model = TinyAVTransformer(dim=case.dim, depth=case.depth, heads=case.heads)
            model.requires_grad_(False)
            add_nft_adapters(model, case.lora_rank, 2 * case.lora_rank, list(DEFAULT_LORA_TARGETS))
        if case.gradient_checkpointing:
            model.enable_gradient_checkpointing()
        shard_module(
            model, shard_units(model), process_group_mesh(None, torch.device(device)), cpu_offload=False
        )
        policy = TinyAVPolicy(model)
        prompts = [f"a red square and a high tone {i}" for i in range(case.batch)]
        cond = {k: v.to(device) for k, v in policy.encode_prompts(prompts).items()}
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device(device):
            model.to_empty(device=device)
            x_t = torch.randn(case.batch, *policy.latent_shape)
            t = torch.full((case.batch,), 0.5)

            def forward() -> Sequence[torch.Tensor]:
                return (policy.velocity(x_t, t, cond),)

            peak = traced_step(model, [x_t, t, *cond.values()], forward, train, device)
        return step_report(case, fake, train, model, peak)


TINY_AV_CASES = (TinyAvCase(), TinyAvCase(name="tiny_av, wider", dim=192, depth=6, heads=6, batch=16))
H3_CASES = (
    TINY_CASE,
    replace(
        TINY_CASE,
        name="small H3, wider",
        frames=39,
        height=96,
        width=128,
        transformer={
            **TINY_CASE.transformer,
            "num_attention_heads": 4,
            "hidden_size": 128,
            "num_layers": 3,
            "ffn_dim": 256,
        },
    ),
)
LTX2_CASES = (TINY_LTX2, replace(TINY_LTX2, name="tiny LTX-2, larger clip", frames=17, height=64, width=96))
TRACES: dict[str, tuple[Callable[..., dict[str, Any]], tuple[Any, ...]]] = {
    "tiny_av": (trace_tiny_av_update, TINY_AV_CASES),
    "minimax_h3": (trace_update, H3_CASES),
    "ltx2": (trace_ltx2_update, LTX2_CASES),
}
"""Per family: the trace function and its two sizes."""


GPU_CASES: dict[str, Any] = {
    "tiny_av": TinyAvCase(name="tiny_av, GPU size", dim=512, depth=8, heads=8, batch=512),
    "minimax_h3": TraceCase(name="4 released H3 blocks, the recipe's sample", transformer={"num_layers": 4}),
    "ltx2": Ltx2Case(name="2 released LTX-2 blocks, the recipe's sample", transformer={"num_layers": 2}),
}
"""Per family, a case large enough (GiB) that a GPU's own allocations (the CUDA context aside, the
cuBLAS workspace: MiB) are small beside it: the released blocks at the recipes' samples, 8 ranks."""


def compare_on_cuda(family: str, train: bool, device: str = "cuda") -> dict[str, Any]:
    """GPU_CASES[family] traced on the CPU (fake tensors) and run on real tensors on `device` under
    the same tracker: the trace's total against torch.cuda.max_memory_allocated over the same step
    (the weights placed before it included), and the tracker's own total on the GPU (GiB)."""
    function, _ = TRACES[family]
    case = GPU_CASES[family]
    traced = function(case, fake=True, train=train)["peak_gib"]
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated(device)
    real = function(case, fake=False, train=train, device=device)["peak_gib"]
    allocated = real.pop(CUDA_MAX_ALLOCATED) - before / GIB
    return {
        "family": family,
        "case": case.name,
        "phase": "micro-step" if train else "forward without gradients",
        "traced_gib": traced["Total"],
        "tracked_on_gpu_gib": real["Total"],
        "cuda_max_allocated_gib": allocated,
        "relative_difference": (traced["Total"] - allocated) / allocated,
    }


def compare(family: str, size: int, ranks: int, train: bool) -> dict[str, Any]:
    """One family at one of its two sizes over `ranks` fake ranks: the trace's and the real run's
    peak per category (GiB) and their largest relative difference."""
    function, cases = TRACES[family]
    case = replace(cases[size], ranks=ranks)
    traced, real = (function(case, fake=fake, train=train)["peak_gib"] for fake in (True, False))
    worst = max(abs(traced.get(k, 0.0) - v) / v for k, v in real.items() if v > 0)
    return {
        "family": family,
        "case": case.name,
        "ranks": ranks,
        "phase": "micro-step" if train else "forward without gradients",
        "traced_gib": traced,
        "real_gib": real,
        "largest_relative_difference": worst,
    }


def run_check(output: Path, ranks: Sequence[int] = (1, 2)) -> list[dict[str, Any]]:
    """Every family at both sizes, both phases, over each count of `ranks`: print a table, write JSON."""
    rows = [
        compare(family, size, n, train)
        for family in TRACES
        for size in (0, 1)
        for n in ranks
        for train in (True, False)
    ]
    print("| family | case | ranks | phase | traced total (KiB) | real total (KiB) | largest difference |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        traced, real = (r[k]["Total"] * GIB / 1024 for k in ("traced_gib", "real_gib"))
        print(
            f"| {r['family']} | {r['case']} | {r['ranks']} | {r['phase']} | {traced:,.1f} | {real:,.1f} "
            f"| {r['largest_relative_difference']:.2%} |"
        )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"unit": "GiB", "rows": rows}, indent=1))
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_diffusion_rl.benchmarks.memory_trace_check")
    parser.add_argument("--output", type=Path, default=Path("runs/bench/memory_trace_check.json"))
    run_check(parser.parse_args(argv).output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
