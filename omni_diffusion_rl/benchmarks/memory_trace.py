"""One training micro-step of MiniMax-H3 at the recipe's size, traced per rank without a GPU.

The real diffusers transformer is built from its config on the meta device, given the project's
LoRA adapters (`add_nft_adapters`) and gradient checkpointing, and sharded with the project's FSDP2
code (`shard_module`) over a fake process group of N ranks. Its storage is then made of fake tensors
(shapes and dtypes, no bytes), and one sample's forward, backward and AdamW step run under torch's
FSDPMemTracker, which counts every byte this rank would hold, by category. The sample is the
recipe's packed sequence (the modular pipeline's own layout: video, stereo audio and text rows).

The same code runs on real tensors (`fake=False`) at small sizes, so the trace can be checked
against bytes that really exist; a test does so.

What it does not trace yet (issue 43): the rollout, decode, the text encoder, the rewards and the
checkpoint. The loss is a stand-in (the mean square of both velocities): NFT's own loss adds two
forwards without gradients (old adapter, reference), which hold no activations for the backward.
GPU kernels may keep other temporaries than the CPU kernels whose shapes are traced here.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

GIB = 2**30
SEED_RANKS = 8
# The released VAE's layout: frames in chunks of 17 keeping 5 latent frames each, 16x spatially.
VAE_CHUNK_FRAMES, VAE_CHUNK_KEPT, VAE_SPATIAL = 17, 5, 16
TINY_TRANSFORMER = {  # a small H3 that really runs on a CPU (the trace is checked against it)
    "num_attention_heads": 2,
    "attention_head_dim": 32,
    "hidden_size": 64,
    "num_layers": 2,
    "num_refiner_layers": 1,
    "ffn_dim": 128,
    "text_dim": 32,
    "freq_dim": 32,
    "time_embed_hidden_dim": 32,
    "time_embed_dim": 16,
    "rope_freq_dim": 2,
}


@dataclass(frozen=True)
class TraceCase:
    """A clip size, an adapter and a layout; `transformer` overrides the released config."""

    name: str = "h3_av_nft (seed layout)"
    ranks: int = SEED_RANKS
    frames: int = 124
    height: int = 768
    width: int = 1344
    text_tokens: int = 128
    lora_rank: int = 64
    gradient_checkpointing: bool = True
    transformer: dict[str, Any] = field(default_factory=dict)


TINY_CASE = TraceCase(
    name="tiny H3",
    ranks=2,
    frames=22,
    height=64,
    width=64,
    text_tokens=8,
    lora_rank=4,
    transformer=TINY_TRANSFORMER,
)


def _build(case: TraceCase) -> tuple[torch.nn.Module, list[torch.nn.Parameter]]:
    """The transformer on the meta device: bf16 base, fp32 LoRA, sharded over every rank."""
    from diffusers import MiniMaxH3Transformer3DModel

    from ..models.lora import add_nft_adapters, trainable_parameters
    from ..models.minimax_h3 import LORA_MODULES
    from ..runtime.sharding import process_group_mesh, shard_module, shard_units

    previous = torch.get_default_dtype()
    with torch.device("meta"):
        torch.set_default_dtype(torch.bfloat16)  # the recipe's base_dtype
        try:
            model = MiniMaxH3Transformer3DModel(**case.transformer)
        finally:
            torch.set_default_dtype(previous)
        blocks = len(model.transformer_blocks)
        targets = [f"transformer_blocks.{i}.{m}" for i in range(blocks) for m in LORA_MODULES]
        add_nft_adapters(model, case.lora_rank, 2 * case.lora_rank, targets)
    if case.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    shard_module(model, shard_units(model), process_group_mesh(None, torch.device("cpu")), cpu_offload=False)
    return model, trainable_parameters(model)


def _layout(case: TraceCase, config: Any) -> tuple[dict[str, torch.Tensor], int, int]:
    """One sample's packed-sequence layout at `case`'s clip size, as MiniMaxH3Policy.h3_velocity
    passes it (real tensors: building it reads values), and its video and audio row counts."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        MINIMAX_H3_AUDIO_TAG,
        MINIMAX_H3_TEXT_TAG,
        MINIMAX_H3_VIDEO_TAG,
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    patch = tuple(int(p) for p in config.patch_size)
    grid = (
        video_latent_num_frames(case.frames, VAE_CHUNK_FRAMES, VAE_CHUNK_KEPT),
        case.height // VAE_SPATIAL,
        case.width // VAE_SPATIAL,
    )
    audio_frames = audio_latent_num_frames(case.frames)
    positions, tags, video_rows, audio_rows, text_rows, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            torch.full((case.text_tokens,), MINIMAX_H3_TEXT_TAG, dtype=torch.long),
            *grid,
            audio_frames,
            patch,
            2,
            MINIMAX_H3_AUDIO_TAG,
            MINIMAX_H3_VIDEO_TAG,
        )
    )
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_rows, audio_rows, 0, 0, case.text_tokens, *[0.5] * 4
    )
    layout = {
        "timestep": timestep,
        "timestep_indices": timestep_indices,
        "position_ids": positions,
        "token_tags": tags,
        "video_indices": video_rows,
        "audio_indices": audio_rows,
        "text_indices": text_rows,
    }
    return layout, len(video_rows), 2 * audio_frames


def _latents(case: TraceCase, config: Any, video_rows: int, audio_rows: int) -> dict[str, torch.Tensor]:
    """The sample's noisy latents and prompt, as rows (fake under a FakeTensorMode)."""
    patch = [int(p) for p in config.patch_size]
    video_features = int(config.in_channels) * patch[0] * patch[1] * patch[2]
    return {
        "hidden_states": torch.randn(1, video_rows, video_features),
        "audio_hidden_states": torch.randn(1, audio_rows, int(config.audio_in_channels)),
        "encoder_hidden_states": torch.randn(1, case.text_tokens, int(config.text_dim)),
    }


def trace_update(case: TraceCase, fake: bool = True) -> dict[str, Any]:
    """Peak bytes of rank 0 over one micro-step of `case`, by FSDPMemTracker's categories (GiB).
    Runs in a process group of its own (fake, `case.ranks` ranks), destroyed afterwards."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("trace_update runs its own (fake) process group: call it outside a run")
    dist.init_process_group("fake", rank=0, world_size=case.ranks, store=FakeStore())
    try:
        model, params = _build(case)
        layout, video_rows, audio_rows = _layout(case, model.config)
        mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
        with mode if mode is not None else torch.device("cpu"):
            model.to_empty(device="cpu")
            latents = _latents(case, model.config, video_rows, audio_rows)
            optimizer = torch.optim.AdamW(params, lr=1e-4)
            tracker = FSDPMemTracker(model, optimizer)
            tracker.track_inputs(tuple(latents.values()))
            with tracker:
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    video, audio = model(**latents, **layout, return_dict=False)
                (video.float().square().mean() + audio.float().square().mean()).backward()
                optimizer.step()
            peak = tracker.get_tracker_snapshot("peak")
        return {
            "case": asdict(case),
            "fake_tensors": fake,
            "parameters_b": sum(p.numel() for p in model.parameters()) / 1e9,  # whole (DTensor numel)
            "adapter_parameters_b": sum(p.numel() for n, p in model.named_parameters() if "lora_" in n) / 1e9,
            "peak_gib": {str(k): v / GIB for k, v in _cpu_peak(peak).items()},
        }
    finally:
        dist.destroy_process_group()


def _cpu_peak(peak: dict[Any, dict[Any, int]]) -> dict[Any, int]:
    """The tracker's peak snapshot for the CPU device (the one the fake ranks compute on)."""
    for device, categories in peak.items():
        if torch.device(device).type == "cpu":
            return {getattr(k, "value", k): v for k, v in categories.items()}
    raise RuntimeError(f"the tracker saw no CPU memory: {list(peak)}")


def table(results: Sequence[dict[str, Any]]) -> str:
    """Rows per case, columns per category (GiB, rank 0)."""
    names = list(results[0]["peak_gib"])
    head = f"{'case':32} {'params (B)':>10} " + " ".join(f"{n[:12]:>12}" for n in names)
    rows = [
        f"{r['case']['name'][:32]:32} {r['parameters_b']:10.2f} "
        + " ".join(f"{r['peak_gib'].get(n, 0.0):12.2f}" for n in names)
        for r in results
    ]
    return "\n".join([head, *rows])


def run_trace(output: Path) -> list[dict[str, Any]]:
    """Trace the recipe's micro-step, print the table beside the on-paper estimate, write JSON."""
    from .memory import Layout, estimate_h3

    results = [trace_update(TraceCase())]
    print("One H3 training micro-step per rank, traced on fake tensors (GiB, FSDPMemTracker's peak;")
    print("the transformer's forward, backward and AdamW step: no rollout, decode, encoder or reward):")
    print(table(results))
    paper = estimate_h3(layout=Layout(sharding="fsdp"))
    on_paper = paper.transformer_gib + paper.gathered_gib + paper.lora_gib + paper.activations_gib
    traced = results[0]["peak_gib"]["Total"]
    print(
        f"on paper, the same parts (transformer shard and gathered blocks, LoRA state, activations): "
        f"{on_paper:.2f} GiB; "
        f"traced {traced:.2f} GiB ({traced - on_paper:+.2f})"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"unit": "GiB", "on_paper_gib": on_paper, "results": results}, indent=2))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_diffusion_rl.benchmarks.memory_trace")
    parser.add_argument("--output", type=Path, default=Path("runs/bench/memory_trace.json"))
    run_trace(parser.parse_args(argv).output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
