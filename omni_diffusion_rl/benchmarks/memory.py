"""`odrl bench memory`: an on-paper estimate of the GPU memory one training process of the LTX-2
and MiniMax-H3 recipes needs, from parameter counts, not a measurement.

Parameters are counted on the meta device (no weights, no download): the transformers and VAEs
from diffusers' default configs (the released sizes: H3 33.1B, LTX-2 18.9B) and the text encoders
from their published architectures (Qwen3-VL 32B's language model, Gemma 3 12B). Per process:

- transformer: its frozen weights at model.base_dtype (bf16);
- text encoder: the H3 conditioner with the 51 of 64 layers it reads (nothing on the GPU with
  offload_text_encoder), LTX-2's Gemma 3 and connectors; VAEs in bf16 except H3's audio VAE (fp32).
  These frozen helpers are never sharded: every process holds its own;
- LoRA: 20 bytes per adapter parameter (trained fp32 weights, their gradient, AdamW's two moments,
  the `old` sampling copy);
- activations at train.micro_batch_size 1 with gradient checkpointing: every block's saved input
  plus one block's recompute (feed-forward and attention buffers), in bf16. They are the process's
  own and do not shrink with sharding;
- a fixed 3 GiB for the CUDA context, allocator slack and the decoders' working memory.

A Layout says how the transformer is held over N training processes (train.sharding,
train.cpu_offload, as omni_diffusion_rl/runtime/sharding.py applies them):

- none: every process holds the whole transformer and LoRA state.
- fsdp (torch FSDP2 `fully_shard` on each repeated block, then on the transformer for the rest):
  each process stores 1/N of every weight, adapter, gradient and AdamW moment. FSDP2 splits a
  parameter's dim 0 into N equal chunks, padding it to a multiple of N, so a shard is counted as
  ceil(rows / N) rows: exact, and at 8 or 16 processes nothing for H3, under 0.05% for LTX-2
  (more where N divides few sizes: over 7 processes the rank-64 adapters pad by 5%).
  On top of the shards, the "gathered" part: what is whole on the GPU while computing. Assumed:
  up to two blocks at once (the one computing and the one prefetched), each gathered whole in its
  stored dtypes (bf16 base, both fp32 adapters) with its trained adapters' unsharded fp32 gradients
  before they are reduce-scattered; and the transformer's own parameters outside the blocks
  (embedders, heads), which FSDP2 keeps unsharded from the forward to the end of the backward (it
  does not reshard the root). This part does not shrink with N.
- fsdp with cpu_offload (FSDP2's CPUOffloadPolicy): the shards of parameters and of gradients live
  in host memory, so the optimizer state is created there and AdamW steps on the CPU; the GPU holds
  only the gathered part. Left out: the host-to-device copy of a shard just before it is gathered
  (1/N of a block, under 0.2 GiB).

Each row also names the smallest common card (CARDS_GB) whose memory holds the total, a card sold
as X GB taken to hold X GiB (A100 80 GB: 80 GiB; H100 80 GB: 79.6 GiB usable).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any

import torch

from ..config import ExperimentConfig
from ..preflight import NOTE, Finding

GIB = 1 << 30
LORA_BYTES = 4 + 4 + 8 + 4
LORA_GATHERED_BYTES = 4 + 4 + 4  # a gathered block's trained and `old` adapters, the trained one's gradient
GATHERED_BLOCKS = 2
OVERHEAD_GIB = 3.0
CARDS_GB = (24, 40, 48, 80, 96, 141)
SEED_PROCESSES = 8

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Layout:
    """How the transformer is held over `processes` training processes."""

    processes: int = SEED_PROCESSES
    sharding: str = "none"
    cpu_offload: bool = False

    def __post_init__(self) -> None:
        if self.processes < 1 or self.sharding not in ("none", "fsdp"):
            raise ValueError(f"no such layout: {self}")
        if self.cpu_offload and self.sharding != "fsdp":
            raise ValueError("cpu_offload offloads the shards of a sharded model: it needs sharding='fsdp'")


@dataclass(frozen=True)
class Estimate:
    recipe: str
    transformer_gib: float
    text_encoder_gib: float
    vaes_gib: float
    lora_gib: float
    activations_gib: float
    overhead_gib: float = OVERHEAD_GIB
    gathered_gib: float = 0.0
    processes: int = SEED_PROCESSES
    sharding: str = "none"
    cpu_offload: bool = False

    @property
    def total_gib(self) -> float:
        parts = (self.transformer_gib, self.gathered_gib, self.text_encoder_gib, self.vaes_gib, self.lora_gib)
        return sum(parts) + self.activations_gib + self.overhead_gib

    @property
    def smallest_card_gb(self) -> int | None:
        """The smallest of CARDS_GB that holds the total, None if none does."""
        return next((card for card in CARDS_GB if self.total_gib <= card), None)


@dataclass(frozen=True)
class Unit:
    """Parameter shapes of one FSDP unit: its frozen base weights and its adapters (A and B)."""

    base: tuple[Shape, ...]
    lora: tuple[Shape, ...] = ()


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _numel(shapes: tuple[Shape, ...]) -> int:
    return sum(math.prod(s) for s in shapes)


def _shard_numel(shapes: tuple[Shape, ...], n: int) -> int:
    """Elements one of `n` processes stores: FSDP2 pads dim 0 to a multiple of `n`, then splits it
    (a scalar is counted whole)."""
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) if s else 1 for s in shapes)


def _lora_shapes(named: list[tuple[str, Any]], pattern: str, rank: int) -> tuple[Shape, ...]:
    """Adapter shapes (A: rank x in, B: out x rank) on the linear layers whose names match `pattern`."""
    shapes: list[Shape] = []
    for name, m in named:
        if re.fullmatch(pattern, name) and hasattr(m, "in_features"):
            shapes += [(rank, m.in_features), (m.out_features, rank)]
    return tuple(shapes)


@cache
def _units(model: Any, pattern: str, rank: int) -> tuple[tuple[Unit, ...], Unit]:
    """The model's repeated blocks as sharding.shard_units finds them, and the rest (the root's)."""
    from ..runtime.sharding import shard_units

    blocks = shard_units(model)
    names = {id(m): n for n, m in model.named_modules()}
    inside = {id(m) for b in blocks for m in b.modules()}
    units = tuple(
        Unit(
            tuple(tuple(p.shape) for p in b.parameters()),
            _lora_shapes([(names[id(m)], m) for m in b.modules()], pattern, rank),
        )
        for b in blocks
    )
    outside = [(n, m) for n, m in model.named_modules() if id(m) not in inside]
    rest_params = tuple(tuple(p.shape) for _, m in outside for p in m.parameters(recurse=False))
    return units, Unit(rest_params, _lora_shapes(outside, pattern, rank))


def _gathered_bytes(unit: Unit, n: int) -> int:
    """A unit gathered whole (the padded all-gather output): bf16 base, adapters and gradient."""
    return n * (_shard_numel(unit.base, n) * 2 + _shard_numel(unit.lora, n) * LORA_GATHERED_BYTES)


def transformer_parts(units: Sequence[Unit], rest: Unit, layout: Layout) -> dict[str, float]:
    """The transformer's weights, LoRA state and gathered part on one process's GPU, in GiB."""
    base = tuple(s for u in [*units, rest] for s in u.base)
    lora = tuple(s for u in [*units, rest] for s in u.lora)
    if layout.sharding == "none":
        return {"transformer_gib": _numel(base) * 2 / GIB, "lora_gib": _numel(lora) * LORA_BYTES / GIB}
    n, held = layout.processes, 0 if layout.cpu_offload else 1
    largest = sorted(_gathered_bytes(u, n) for u in units)[-GATHERED_BLOCKS:]
    rest_whole = _numel(rest.base) * 2 + _numel(rest.lora) * LORA_GATHERED_BYTES
    return {
        "transformer_gib": held * _shard_numel(base, n) * 2 / GIB,
        "lora_gib": held * _shard_numel(lora, n) * LORA_BYTES / GIB,
        "gathered_gib": (sum(largest) + rest_whole) / GIB,
    }


def _layout_fields(layout: Layout) -> dict[str, Any]:
    return {"processes": layout.processes, "sharding": layout.sharding, "cpu_offload": layout.cpu_offload}


@cache
def _qwen3_vl_32b_text_layers(layers: int) -> int:
    """Qwen3-VL 32B's language model cut to `layers` decoder layers (its published shape)."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=layers,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
    )
    with torch.device("meta"):  # created there: nothing allocated or initialised
        return _count(Qwen3Model(config))


def gemma3_12b_text_config() -> Any:
    """Gemma 3 12B's language model configuration (its published shape), LTX-2's text encoder."""
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=1024,
    )


@cache
def _gemma3_12b_text() -> int:
    """Gemma 3 12B's language model's parameters."""
    from transformers import Gemma3TextModel

    with torch.device("meta"):  # created there: nothing allocated or initialised
        return _count(Gemma3TextModel(gemma3_12b_text_config()))


@cache
def _h3_meta() -> tuple[Any, int]:
    """H3's transformer on the meta device and its VAEs' bytes (bf16 video, fp32 audio)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    with torch.device("meta"):  # created there: nothing allocated or initialised
        transformer = MiniMaxH3Transformer3DModel()
        vaes = _count(AutoencoderKLMiniMaxH3()) * 2 + _count(AutoencoderKLMiniMaxH3Audio()) * 4
    return transformer, vaes


@cache
def _ltx2_meta() -> tuple[Any, int, int]:
    """LTX-2's transformer on the meta device, its decoders' and its text connectors' parameters."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    with torch.device("meta"):  # created there: nothing allocated or initialised
        transformer = LTX2VideoTransformer3DModel()
        decoders = _count(AutoencoderKLLTX2Video()) + _count(AutoencoderKLLTX2Audio())
        return transformer, decoders, _count(LTX2TextConnectors())


def estimate_h3(
    rank: int = 64,
    frames: int = 124,
    height: int = 768,
    width: int = 1344,
    offload_text_encoder: bool = True,
    layout: Layout = Layout(),
) -> Estimate:
    """The h3_av_nft recipe: bf16 base, LoRA `rank`, a `frames` x `height` x `width` clip."""
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    transformer, vaes = _h3_meta()
    c = transformer.config
    pattern = r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"
    rows = video_latent_num_frames(frames, 17, 5) * (height // 32) * (width // 32)
    rows += 2 * audio_latent_num_frames(frames) + 128  # stereo audio rows and about 128 text tokens
    saved = rows * c.hidden_size * 2 * c.num_layers
    block = rows * (3 * c.ffn_dim + 12 * c.hidden_size) * 2
    conditioner = 0 if offload_text_encoder else _qwen3_vl_32b_text_layers(51) * 2
    return Estimate(
        recipe=f"h3_av_nft ({frames} frames {height}x{width}, LoRA {rank}, conditioner "
        f"{'offloaded' if offload_text_encoder else 'on the GPU'})",
        text_encoder_gib=conditioner / GIB,
        vaes_gib=vaes / GIB,
        activations_gib=(saved + block) / GIB,
        **transformer_parts(*_units(transformer, pattern, rank), layout),
        **_layout_fields(layout),
    )


def estimate_ltx2(
    rank: int = 64,
    frames: int = 121,
    height: int = 512,
    width: int = 768,
    frame_rate: float = 24.0,
    layout: Layout = Layout(),
) -> Estimate:
    """The ltx2_av_nft recipe: bf16 base, LoRA `rank`, a `frames` x `height` x `width` clip."""
    transformer, decoders, connectors = _ltx2_meta()
    c = transformer.config
    video_width, audio_width = c.num_attention_heads * c.attention_head_dim, 2048
    video_tokens = ((frames - 1) // 8 + 1) * (height // 32) * (width // 32)
    audio_tokens = math.ceil(frames / frame_rate * 25)
    saved = (video_tokens * video_width + audio_tokens * audio_width) * 2 * c.num_layers
    block = video_tokens * video_width * 16 * 2  # feed-forward (4x, gated) and attention buffers
    return Estimate(
        recipe=f"ltx2_av_nft ({frames} frames {height}x{width}, LoRA {rank})",
        text_encoder_gib=(_gemma3_12b_text() + connectors) * 2 / GIB,
        vaes_gib=decoders * 2 / GIB,
        activations_gib=(saved + block) / GIB,
        **transformer_parts(*_units(transformer, r".*\.(to_q|to_k|to_v|to_out\.0)", rank), layout),
        **_layout_fields(layout),
    )


def estimate_config(cfg: ExperimentConfig, processes: int = SEED_PROCESSES) -> Estimate:
    """The estimate for a loaded ltx2 or minimax_h3 config launched on `processes` processes."""
    model, train = cfg.model, cfg.train
    assumed = (model.base_dtype, model.gradient_checkpointing, train.micro_batch_size, model.lora_targets)
    if assumed != ("bf16", True, 1, []):
        raise ValueError(
            "the estimate covers model.base_dtype=bf16, model.gradient_checkpointing=true, "
            "train.micro_batch_size=1 and the family's default LoRA targets"
        )
    layout = Layout(processes, train.sharding, train.cpu_offload)
    clip = {
        k: model.options[o]
        for k, o in (("frames", "num_frames"), ("height", "height"), ("width", "width"))
        if o in model.options
    }
    if model.family == "ltx2":
        return estimate_ltx2(
            model.lora_rank, layout=layout, frame_rate=model.options.get("frame_rate", 24.0), **clip
        )
    if model.family == "minimax_h3":
        offload = bool(model.options.get("offload_text_encoder", False))
        return estimate_h3(model.lora_rank, offload_text_encoder=offload, layout=layout, **clip)
    raise ValueError(f"no memory estimate for model.family={model.family} (ltx2 and minimax_h3 only)")


def check_rollout_memory(cfg: ExperimentConfig) -> list[Finding]:
    """For LTX-2 and H3 in separate or hybrid mode: the rollout processes hold whole copies
    (train.sharding shards the trainers only), so say how much on paper (odrl bench memory)."""
    if cfg.model.family not in ("ltx2", "minimax_h3") or cfg.execution.mode not in ("separate", "hybrid"):
        return []
    whole = replace(cfg, train=replace(cfg.train, sharding="none", cpu_offload=False))
    try:
        e = estimate_config(whole, processes=1)
    except ValueError as error:
        return [Finding(NOTE, "execution.mode", f"no memory estimate for its rollout processes: {error}")]
    weights = e.transformer_gib + e.text_encoder_gib + e.vaes_gib + e.lora_gib + e.overhead_gib
    return [
        Finding(
            NOTE,
            "execution.mode",
            f"{cfg.execution.mode}: each rollout process holds whole copies (train.sharding shards the "
            f"trainers only): {weights:.0f} GiB of weights on paper (odrl bench memory), plus its sampling "
            "and the decode of its clips (traced for H3: docs/real-models.md, Memory per GPU); colocated "
            "mode shards every process",
        )
    ]


def _card(e: Estimate) -> str:
    card = e.smallest_card_gb
    return f"{card} GB" if card else f"none (> {CARDS_GB[-1]} GB)"


def table(estimates: list[Estimate]) -> str:
    head = (
        "| recipe | processes | sharding | offload | transformer | gathered | text encoder | VAEs "
        "| LoRA + AdamW | activations | other | total | smallest card |"
    )
    rows = [head, "|" + " --- |" * 13]
    for e in estimates:
        layout = f"{e.processes} | {e.sharding} | {'yes' if e.cpu_offload else 'no'}"
        cells = (
            e.transformer_gib,
            e.gathered_gib,
            e.text_encoder_gib,
            e.vaes_gib,
            e.lora_gib,
            e.activations_gib,
            e.overhead_gib,
        )
        numbers = " | ".join(f"{v:.1f}" for v in cells)
        rows.append(f"| {e.recipe} | {layout} | {numbers} | **{e.total_gib:.0f}** | {_card(e)} |")
    return "\n".join(rows)


def bench_estimates() -> list[Estimate]:
    """Each recipe at the seed's layout (8 processes, micro-batch 1, gradient checkpointing) whole,
    sharded, and sharded with offload; then H3's conditioner on the GPU and a shorter H3 clip."""
    whole, sharded = Layout(), Layout(sharding="fsdp")
    offloaded = Layout(sharding="fsdp", cpu_offload=True)
    return [
        *(estimate_ltx2(layout=layout) for layout in (whole, sharded, offloaded)),
        *(estimate_h3(layout=layout) for layout in (whole, sharded, offloaded)),
        estimate_h3(offload_text_encoder=False),
        estimate_h3(offload_text_encoder=False, layout=sharded),
        estimate_h3(frames=56, height=512, width=896),
    ]


def run_memory_bench(output: Path) -> list[Estimate]:
    """Print the table (GiB per process) and write it as JSON."""
    estimates = bench_estimates()
    print("Estimated GPU memory per training process (GiB, on paper from parameter counts):")
    print(table(estimates))
    print(f"smallest card: the smallest of {', '.join(map(str, CARDS_GB))} GB that holds the total")
    output.parent.mkdir(parents=True, exist_ok=True)
    rows = [
        {**asdict(e), "total_gib": e.total_gib, "smallest_card_gb": e.smallest_card_gb} for e in estimates
    ]
    output.write_text(json.dumps({"unit": "GiB", "cards_gb": list(CARDS_GB), "estimates": rows}, indent=2))
    return estimates
