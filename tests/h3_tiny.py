"""Tiny random-init MiniMax-H3 components (no download), sized so that every width the modular
pipeline wires together agrees (docs/research/minimax_h3.md lists the constraints), saved in the
folder layout `MiniMaxH3Policy.from_pretrained` reads."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

VIDEO_CHANNELS, AUDIO_CHANNELS, TEXT_WIDTH, TEXT_LAYERS = 4, 8, 16, 4
CLIP = {"height": 32, "width": 32, "num_frames": 22, "text_encoder_layer": 2, "max_sequence_length": 96}
"""22 frames: the smallest clip the video VAE decodes (17 + 5 -> 7 latent frames), 8 x 8 latents."""


def tiny_h3_components(seed: int = 0) -> dict[str, Any]:
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen2TokenizerFast, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    words = ["<|endoftext|>", "<unk>", *string.ascii_lowercase, *string.digits, "\u0120"]
    tokenizer = Qwen2TokenizerFast(
        vocab={w: i for i, w in enumerate(words)}, merges=[], unk_token="<unk>", eos_token="<|endoftext|>"
    )
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    text = {
        "vocab_size": vocab + 4,
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 512,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1]},
    }
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 16}
    vision |= {
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 1,
        "deepstack_visual_indexes": [0],
    }
    special = {"image_token_id": vocab, "video_token_id": vocab + 1}
    special |= {"vision_start_token_id": vocab + 2, "vision_end_token_id": vocab + 3}
    text_encoder = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=text, vision_config=vision, **special)
    ).eval()
    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=16,  # >= 6 x rope_freq_dim
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=64,
        in_channels=VIDEO_CHANNELS,
        audio_in_channels=AUDIO_CHANNELS,
        patch_size=(1, 2, 2),
        text_dim=TEXT_WIDTH,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=VIDEO_CHANNELS,
        block_out_channels=(8, 8),
        layers_per_block=1,
        spatial_downsample_factors=(2, 2),  # each temporal x2 paired with a spatial x2, as the real VAE
        temporal_downsample_factors=(2, 2),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=1,
        decoder_attention_head_dim=8,
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
        latents_mean=(0.1, -0.2, 0.0, 0.3),  # not 0/1, so a missing denormalisation shows
        latents_std=(1.5, 0.5, 1.0, 2.0),
    )
    audio_vae = AutoencoderKLMiniMaxH3Audio(  # the real hop of 800 samples: 40 latents per second at 32 kHz
        encoder_dim=2,
        encoder_rates=(2, 4, 4, 5, 5),
        latent_dim=16,
        latent_channels=AUDIO_CHANNELS,
        num_attention_heads=2,
        decoder_dim=128,
        decoder_rates=(5, 5, 2, 2, 2, 2, 2),
        decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        latents_mean=[0.05 * i for i in range(AUDIO_CHANNELS)],
        latents_std=[1.0 + 0.1 * i for i in range(AUDIO_CHANNELS)],
    )
    return {
        "transformer": transformer,
        "vae": vae,
        "audio_vae": audio_vae,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
    }


def save_tiny_h3(path: Path, seed: int = 0) -> Path:
    """The tiny components as component folders under `path`."""
    for name, component in tiny_h3_components(seed).items():
        component.save_pretrained(path / name)
    return path
