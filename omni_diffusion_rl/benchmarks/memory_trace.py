"""MiniMax-H3 at the recipe's size, traced per rank without a GPU: one training micro-step, a rollout
forward and the rollout's decode of one rank's clips. LTX-2's traces are in memory_trace_ltx2.py
(this module's `run_trace` runs them too).

The real diffusers transformer is built from its config on the meta device, given the project's
LoRA adapters (`add_nft_adapters`) and gradient checkpointing, and sharded with the project's FSDP2
code (`shard_module`) over a fake process group of N ranks. Its storage is then made of fake tensors
(shapes and dtypes, no bytes), and one sample's forward, backward and AdamW step run under torch's
FSDPMemTracker, which counts every byte this rank would hold, by category. The sample is the
recipe's packed sequence (the modular pipeline's own layout: video, stereo audio and text rows).

The same code runs on real tensors (`fake=False`) at small sizes, so the trace can be checked
against bytes that really exist; a test does so.

The decode runs MiniMaxH3Policy.decode through the released VAEs (built from their diffusers
configs, the video VAE in bf16 with its own tiling, vae_slicing as the recipe sets it) under
MemTracker, on fake tensors too; a test checks it against real tensors at a small size.

A rollout's transformer call is the same forward without gradients (`train=False`).

Qwen2.5-Omni-7B's and Qwen3-Omni-30B-A3B's GSPO micro-steps are traced in memory_trace_qwen.py, the
ImageBind reward's request in memory_trace_rewards.py. What is not traced (issue 43): H3's
conditioner (offloaded: it runs in host memory) and the checkpoint, which docs/real-models.md
counts. The micro-step's loss is a stand-in (the mean square of both velocities): NFT's own loss adds two
forwards without gradients (old adapter, reference), each one such forward, whose outputs alone
outlive it. GPU kernels may keep other temporaries than the CPU kernels whose shapes are traced here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..precision import default_dtype
from .memory_tracing import (
    GIB,
    SEED_RANKS,
    WholeCallTracker,
    check_trace_device,
    fake_process_group,
    peak_on,
    step_report,
    traced_step,
)

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


def _build(case: TraceCase, device: str = "cpu") -> torch.nn.Module:
    """The transformer on the meta device: bf16 base, fp32 LoRA, sharded over every rank (a mesh of
    `device`'s type)."""
    from diffusers import MiniMaxH3Transformer3DModel

    from ..models.lora import add_nft_adapters
    from ..models.minimax_h3 import LORA_MODULES
    from ..runtime.sharding import process_group_mesh, shard_module, shard_units

    with torch.device("meta"):
        with default_dtype(torch.bfloat16):  # the recipe's base_dtype
            model = MiniMaxH3Transformer3DModel(**case.transformer)
        blocks = len(model.transformer_blocks)
        targets = [f"transformer_blocks.{i}.{m}" for i in range(blocks) for m in LORA_MODULES]
        add_nft_adapters(model, case.lora_rank, 2 * case.lora_rank, targets)
    if case.gradient_checkpointing:
        model.enable_gradient_checkpointing()
    shard_module(model, shard_units(model), process_group_mesh(None, torch.device(device)), cpu_offload=False)
    return model


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


def trace_update(
    case: TraceCase, fake: bool = True, train: bool = True, device: str = "cpu"
) -> dict[str, Any]:
    """Peak bytes of rank 0 over one micro-step of `case`, by FSDPMemTracker's categories (GiB);
    `train=False`: one forward without gradients instead (a rollout's call, or NFT's old-adapter and
    reference forwards). Runs in a process group of its own (fake, `case.ranks` ranks), destroyed
    afterwards. `device`: where a real run (`fake=False`) computes (a GPU check: traced_step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    device = check_trace_device(fake, device)
    with fake_process_group(case.ranks, "trace_update"):
        model = _build(case, device)
        layout, video_rows, audio_rows = _layout(case, model.config)
        layout = {k: v.to(device) for k, v in layout.items()}
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else torch.device(device):
            model.to_empty(device=device)
            latents = _latents(case, model.config, video_rows, audio_rows)

            def forward() -> Sequence[torch.Tensor]:
                with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
                    return model(**latents, **layout, return_dict=False)

            peak = traced_step(model, list(latents.values()), forward, train, device)
        return step_report(case, fake, train, model, peak)


@dataclass(frozen=True)
class DecodeCase:
    """One rank's rollout decode: `samples` clips (the recipe's group, one per rank) through H3's
    VAEs as MiniMaxH3Policy.decode runs them; `tiny`: the tiny random-init VAEs that really run here."""

    name: str = "h3_av_nft decode (one rank)"
    samples: int = 16
    frames: int = 124
    height: int = 768
    width: int = 1344
    vae_slicing: bool = True  # the recipe's model.options
    tiny: bool = False


TINY_DECODE = DecodeCase(name="tiny H3 decode", samples=3, frames=22, height=32, width=32, tiny=True)


def _decode_components(case: DecodeCase) -> dict[str, Any]:
    """H3's components for a decode: the released VAEs on the meta device (the video VAE in bf16,
    the recipe's base_dtype; the audio VAE fp32, as MiniMaxH3Policy keeps it), beside a one-block
    transformer on meta and the tiny conditioner, neither of which a decode touches; or the tiny
    random-init components."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    from .tiny_families import tiny_h3_components, tiny_h3_conditioner

    if case.tiny:
        return tiny_h3_components()
    with torch.device("meta"):
        transformer = MiniMaxH3Transformer3DModel(num_layers=1)  # its config only: the decode never runs it
        audio_vae = AutoencoderKLMiniMaxH3Audio(latents_mean=[0.0] * 32, latents_std=[1.0] * 32)
        with default_dtype(torch.bfloat16):
            vae = AutoencoderKLMiniMaxH3(latents_mean=[0.0] * 24, latents_std=[1.0] * 24)
    return {"transformer": transformer, "vae": vae, "audio_vae": audio_vae, **tiny_h3_conditioner()}


def trace_decode(case: DecodeCase, fake: bool = True) -> dict[str, Any]:
    """Peak bytes of one rank over MiniMaxH3Policy.decode of `case.samples` clips (GiB, MemTracker's
    categories): the VAEs' weights, the float32 frames it returns and every temporary on the way."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from ..models.minimax_h3 import MiniMaxH3Policy

    clip = {"height": case.height, "width": case.width, "num_frames": case.frames}
    policy = MiniMaxH3Policy(
        _decode_components(case),
        **clip,
        text_encoder_layer=2,
        max_sequence_length=96,
        vae_slicing=case.vae_slicing,
    )
    with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
        if fake:
            policy.vae.to_empty(device="cpu")
            policy.audio_vae.to_empty(device="cpu")
        latents = torch.randn(case.samples, *policy.latent_shape)
        tracker = WholeCallTracker()
        tracker.track_external(policy.vae, policy.audio_vae, latents)
        with tracker:
            media = policy.decode(latents)
        peak = tracker.get_tracker_snapshot("peak")
    return {
        "case": asdict(case),
        "fake_tensors": fake,
        "vae_parameters_b": sum(p.numel() for p in policy.vae.parameters()) / 1e9,
        "frames_gib": media.video.numel() * media.video.element_size() / GIB,
        "peak_gib": {str(k): v / GIB for k, v in peak_on(peak).items()},
    }


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


def decode_per_rank(case: DecodeCase = DecodeCase()) -> dict[str, Any]:
    """The decode of `case` on one rank from traces of 2 and 3 clips at its size. With vae_slicing
    each clip is decoded alone into frames made once for all (after the first clip's decode, so the
    first clip's peak differs), and from the second on every clip adds the same: its float32 frames
    and its share of the batch's audio decode (a test checks it on real tensors). At full size one
    clip takes about 2 minutes to trace, all 16 about half an hour."""
    from dataclasses import replace

    two, three = (trace_decode(replace(case, samples=n)) for n in (2, 3))
    step = three["peak_gib"]["Total"] - two["peak_gib"]["Total"]
    return {
        "case": asdict(case),
        "traced": [two, three],
        "per_further_clip_gib": step,
        "frames_per_clip_gib": two["frames_gib"] / 2,
        "peak_gib": three["peak_gib"]["Total"] + (case.samples - 3) * step,
        "vae_weights_gib": two["peak_gib"]["Parameter"],
    }


def run_trace(output: Path) -> list[dict[str, Any]]:
    """Trace the recipe's micro-step and its rollout decode, print both beside the on-paper
    estimate, write JSON."""
    from .memory import Layout, estimate_h3

    results = [trace_update(TraceCase())]
    print("One H3 training micro-step per rank, traced on fake tensors (GiB, FSDPMemTracker's peak;")
    print("the transformer's forward, backward and AdamW step: no rollout, encoder or reward):")
    print(table(results))
    paper = estimate_h3(layout=Layout(sharding="fsdp"))
    on_paper = paper.transformer_gib + paper.gathered_gib + paper.lora_gib + paper.activations_gib
    traced = results[0]["peak_gib"]["Total"]
    print(
        f"on paper, the same parts (transformer shard and gathered blocks, LoRA state, activations): "
        f"{on_paper:.2f} GiB; "
        f"traced {traced:.2f} GiB ({traced - on_paper:+.2f})"
    )
    forward = trace_update(TraceCase(), train=False)
    print(
        f"one rollout forward without gradients (a sample per call, as sharded rollouts run; also NFT's "
        f"old-adapter and reference forwards): {forward['peak_gib']['Total']:.2f} GiB "
        f"(activations {forward['peak_gib']['Activation']:.2f})"
    )
    from .memory_trace_ltx2 import (
        LTX2_RANK_CLIPS,
        Ltx2Case,
        trace_ltx2_decode,
        trace_ltx2_prompts,
        trace_ltx2_update,
    )

    ltx2 = [trace_ltx2_update(Ltx2Case(), train=train) for train in (True, False)]
    ltx2_decode = trace_ltx2_decode(Ltx2Case(), LTX2_RANK_CLIPS)
    ltx2_prompts = trace_ltx2_prompts(Ltx2Case())
    print(
        f"LTX-2 per rank of 8 (121 frames at 512x768, LoRA r64): a training micro-step "
        f"{ltx2[0]['peak_gib']['Total']:.2f} GiB (activations {ltx2[0]['peak_gib']['Activation']:.2f}), "
        f"a forward without gradients {ltx2[1]['peak_gib']['Total']:.2f}, the decode of the rank's "
        f"{LTX2_RANK_CLIPS} clips {ltx2_decode['peak_gib']['Total']:.2f} "
        f"(frames {ltx2_decode['frames_gib']:.2f}), the encoding of its prompt "
        f"{ltx2_prompts['peak_gib']['Total']:.2f} (Gemma 3 and the connectors, whole on every rank, "
        f"{ltx2_prompts['peak_gib']['Parameter']:.2f})"
    )
    decode = decode_per_rank()
    two = decode["traced"][0]["peak_gib"]["Total"]
    print(
        f"the rollout's decode on one rank ({decode['case']['samples']} clips of {decode['case']['frames']} "
        f"frames at {decode['case']['height']}x{decode['case']['width']}, vae_slicing): 2 clips traced "
        f"{two:.2f} GiB (VAE weights {decode['vae_weights_gib']:.2f}), each further clip "
        f"+{decode['per_further_clip_gib']:.2f} (its float32 frames {decode['frames_per_clip_gib']:.2f}): "
        f"{decode['peak_gib']:.2f} GiB, beside what stays resident from training"
    )
    output.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "unit": "GiB",
        "on_paper_gib": on_paper,
        "results": results,
        "rollout_forward": forward,
        "decode": decode,
        "ltx2": ltx2,
        "ltx2_decode": ltx2_decode,
        "ltx2_prompts": ltx2_prompts,
    }
    output.write_text(json.dumps(report, indent=2))
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m omni_diffusion_rl.benchmarks.memory_trace")
    parser.add_argument("--output", type=Path, default=Path("runs/bench/memory_trace.json"))
    run_trace(parser.parse_args(argv).output)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
