"""`odrl bench memory`: an on-paper estimate of the GPU memory one training process of the LTX-2
and MiniMax-H3 recipes needs, from parameter counts, not a measurement.

Parameters are counted on the meta device (no weights, no download): the transformers and VAEs
from diffusers' default configs (the released sizes: H3 33.1B, LTX-2 18.9B) and the text encoders
from their published architectures (Qwen3-VL 32B's language model, Gemma 3 12B). Each process
holds whole copies (no sharding). Per process:

- base weights: transformer and text encoder at model.base_dtype (the H3 conditioner with the 51
  of 64 layers it reads, or nothing on the GPU with offload_text_encoder), VAEs in bf16 except
  H3's audio VAE (fp32);
- LoRA: 20 bytes per adapter parameter (trained fp32 weights, their gradient, AdamW's two moments,
  the `old` sampling copy);
- activations at train.micro_batch_size 1 with gradient checkpointing: every block's saved input
  plus one block's recompute (feed-forward and attention buffers), in bf16;
- a fixed 3 GiB for the CUDA context, allocator slack and the decoders' working memory.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

GIB = 1 << 30
LORA_BYTES = 4 + 4 + 8 + 4
OVERHEAD_GIB = 3.0


@dataclass(frozen=True)
class Estimate:
    recipe: str
    transformer_gib: float
    text_encoder_gib: float
    vaes_gib: float
    lora_gib: float
    activations_gib: float
    overhead_gib: float = OVERHEAD_GIB

    @property
    def total_gib(self) -> float:
        parts = (self.transformer_gib, self.text_encoder_gib, self.vaes_gib, self.lora_gib)
        return sum(parts) + self.activations_gib + self.overhead_gib


def _count(module: Any) -> int:
    return sum(p.numel() for p in module.parameters())


def _lora_params(model: Any, pattern: str, rank: int) -> int:
    """Adapter parameters of rank `rank` on the linear layers whose names match `pattern`."""
    return sum(
        rank * (m.in_features + m.out_features)
        for name, m in model.named_modules()
        if re.fullmatch(pattern, name) and hasattr(m, "in_features")
    )


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


def _gemma3_12b_text() -> int:
    """Gemma 3 12B's language model (its published shape)."""
    from transformers import Gemma3TextConfig, Gemma3TextModel

    config = Gemma3TextConfig(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
    )
    with torch.device("meta"):  # created there: nothing allocated or initialised
        return _count(Gemma3TextModel(config))


def estimate_h3(
    rank: int = 64, frames: int = 124, height: int = 768, width: int = 1344, offload: bool = True
):
    """The h3_av_nft recipe: bf16 base, LoRA `rank`, a `frames` x `height` x `width` clip."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
        audio_latent_num_frames,
        video_latent_num_frames,
    )

    with torch.device("meta"):  # created there: nothing allocated or initialised
        transformer = MiniMaxH3Transformer3DModel()
        vae, audio_vae = AutoencoderKLMiniMaxH3(), AutoencoderKLMiniMaxH3Audio()
    c = transformer.config
    lora = _lora_params(
        transformer, r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))", rank
    )
    rows = video_latent_num_frames(frames, 17, 5) * (height // 32) * (width // 32)
    rows += 2 * audio_latent_num_frames(frames) + 128  # stereo audio rows and about 128 text tokens
    saved = rows * c.hidden_size * 2 * c.num_layers
    block = rows * (3 * c.ffn_dim + 12 * c.hidden_size) * 2
    conditioner = 0 if offload else _qwen3_vl_32b_text_layers(51) * 2
    return Estimate(
        recipe=f"h3_av_nft ({frames} frames {height}x{width}, LoRA {rank}, conditioner "
        f"{'offloaded' if offload else 'on the GPU'})",
        transformer_gib=_count(transformer) * 2 / GIB,
        text_encoder_gib=conditioner / GIB,
        vaes_gib=(_count(vae) * 2 + _count(audio_vae) * 4) / GIB,
        lora_gib=lora * LORA_BYTES / GIB,
        activations_gib=(saved + block) / GIB,
    )


def estimate_ltx2(rank: int = 64, frames: int = 121, height: int = 512, width: int = 768) -> Estimate:
    """The ltx2_av_nft recipe: bf16 base, LoRA `rank`, a `frames` x `height` x `width` clip at 24 fps."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, LTX2VideoTransformer3DModel
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    with torch.device("meta"):  # created there: nothing allocated or initialised
        transformer = LTX2VideoTransformer3DModel()
        decoders = _count(AutoencoderKLLTX2Video()) + _count(AutoencoderKLLTX2Audio())
        connectors = _count(LTX2TextConnectors())
    c = transformer.config
    lora = _lora_params(transformer, r".*\.(to_q|to_k|to_v|to_out\.0)", rank)
    video_width, audio_width = c.num_attention_heads * c.attention_head_dim, 2048
    video_tokens = ((frames - 1) // 8 + 1) * (height // 32) * (width // 32)
    audio_tokens = math.ceil(frames / 24 * 25)
    saved = (video_tokens * video_width + audio_tokens * audio_width) * 2 * c.num_layers
    block = video_tokens * video_width * 16 * 2  # feed-forward (4x, gated) and attention buffers
    return Estimate(
        recipe=f"ltx2_av_nft ({frames} frames {height}x{width}, LoRA {rank})",
        transformer_gib=_count(transformer) * 2 / GIB,
        text_encoder_gib=(_gemma3_12b_text() + connectors) * 2 / GIB,
        vaes_gib=decoders * 2 / GIB,
        lora_gib=lora * LORA_BYTES / GIB,
        activations_gib=(saved + block) / GIB,
    )


def table(estimates: list[Estimate]) -> str:
    head = "| recipe | transformer | text encoder | VAEs | LoRA + AdamW | activations | other | total |"
    rows = [head, "|" + " --- |" * 8]
    for e in estimates:
        cells = (
            e.transformer_gib,
            e.text_encoder_gib,
            e.vaes_gib,
            e.lora_gib,
            e.activations_gib,
            e.overhead_gib,
        )
        rows.append(
            f"| {e.recipe} | " + " | ".join(f"{v:.1f}" for v in cells) + f" | **{e.total_gib:.0f}** |"
        )
    return "\n".join(rows)


def run_memory_bench(output: Path) -> list[Estimate]:
    """Print the table (GiB per process) and write it as JSON."""
    estimates = [
        estimate_ltx2(),
        estimate_h3(offload=True),
        estimate_h3(offload=False),
        estimate_h3(frames=56, height=512, width=896, offload=True),
    ]
    print("Estimated GPU memory per training process (GiB, on paper from parameter counts):")
    print(table(estimates))
    output.parent.mkdir(parents=True, exist_ok=True)
    rows = [{**asdict(e), "total_gib": e.total_gib} for e in estimates]
    output.write_text(json.dumps({"unit": "GiB", "estimates": rows}, indent=2))
    return estimates
