"""Tiny random-init LTX-2 and MiniMax-H3 models (no download), saved in the folder layout their
policies load: the tests' fixtures and the models of the measured memory benchmark.

Every width the pipelines wire together agrees (docs/research/ltx2_pipeline.md and
docs/research/minimax_h3.md list the constraints). `width` is the transformer's hidden width: the
default keeps every component a few thousand parameters (the tests); a wider transformer (64-128)
makes FSDP2's per-parameter dim-0 padding negligible next to the weights (the benchmark). The text
encoders, VAEs and vocoder keep their tiny sizes at every width.

`AV_LEVEL_PLUGIN` is a reward plug-in (mean brightness plus mean loudness, so it needs both streams)
for the `reward.plugins` of launched runs.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import torch

from ..reward import RewardOutput

# ---------------------------------------------------------------- LTX-2
LTX2_TEXT_WIDTH, LTX2_TEXT_LAYERS = 16, 2  # Gemma hidden size = caption channels; connectors read layers + 1
LTX2_VIDEO_CHANNELS, LTX2_AUDIO_CHANNELS, LTX2_MEL_BINS = 4, 2, 8
LTX2_AUDIO_TOKEN = LTX2_AUDIO_CHANNELS * (LTX2_MEL_BINS // 4)  # audio_in_channels = audio VAE base_channels
LTX2_WIDTH = 16
"""The transformer's video width (2 heads); its audio width is half of it."""
LTX2_CLIP = {"height": 32, "width": 32, "num_frames": 9, "frame_rate": 25.0, "max_sequence_length": 16}
LTX2_GUIDANCE_OFF = {
    "guidance_scale": 1.0,
    "audio_guidance_scale": 1.0,
    "stg_scale": 0.0,
    "audio_stg_scale": 0.0,
    "modality_scale": 1.0,
    "audio_modality_scale": 1.0,
    "guidance_rescale": 0.0,
    "audio_guidance_rescale": 0.0,
    "spatio_temporal_guidance_blocks": None,
}


def tiny_ltx2_pipeline(seed: int = 0, width: int = LTX2_WIDTH):  # noqa: ANN201 - diffusers is imported lazily
    """A random-init LTX2Pipeline whose transformer is `width` wide (a multiple of 4)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    if width % 4:
        raise ValueError(f"width {width}: the LTX-2 transformer's width must be a multiple of 4")
    tokenizer = _ltx2_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _ltx2_text_encoder(len(tokenizer))
    vae = _ltx2_video_vae()
    pipeline = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=_ltx2_transformer(width, vae.temporal_compression_ratio, vae.spatial_compression_ratio),
        connectors=_ltx2_connectors(),
        audio_vae=_ltx2_audio_vae(),
        vocoder=_ltx2_vocoder(),
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


def save_tiny_ltx2(path: Path, seed: int = 0, width: int = LTX2_WIDTH) -> Path:
    """The tiny pipeline saved under `path` (its component folders); returns `path`."""
    tiny_ltx2_pipeline(seed, width).save_pretrained(path)
    return path


def _ltx2_tokenizer():  # noqa: ANN202
    from transformers import GemmaTokenizer

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *string.ascii_lowercase, *string.digits, "\u2581"]
    tokenizer = GemmaTokenizer(vocab={w: i for i, w in enumerate(words)}, merges=[])
    tokenizer.model_max_length = 64
    return tokenizer


def _ltx2_text_encoder(vocab_size: int):  # noqa: ANN202
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    text = {
        "vocab_size": vocab_size,
        "hidden_size": LTX2_TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": LTX2_TEXT_LAYERS,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "max_position_embeddings": 128,
        "sliding_window": 16,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "bos_token_id": 2,
    }
    vision = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    vision |= {"image_size": 28, "patch_size": 14}
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4)
    return Gemma3ForConditionalGeneration(config).eval()


def _ltx2_video_vae():  # noqa: ANN202
    from diffusers import AutoencoderKLLTX2Video

    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=LTX2_VIDEO_CHANNELS,
        block_out_channels=(8,),
        decoder_block_out_channels=(8,),
        layers_per_block=(1,),
        decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False),
        downsample_type=("spatiotemporal",),
        upsample_residual=(False,),
        upsample_factor=(1,),
        timestep_conditioning=False,
        patch_size=4,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = vae.use_framewise_decoding = False
    return vae


def _ltx2_transformer(width: int, ratio_t: int, ratio_s: int):  # noqa: ANN202
    from diffusers import LTX2VideoTransformer3DModel

    return LTX2VideoTransformer3DModel(
        in_channels=LTX2_VIDEO_CHANNELS,
        out_channels=LTX2_VIDEO_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=width // 2,
        cross_attention_dim=width,
        vae_scale_factors=(ratio_t, ratio_s, ratio_s),
        audio_in_channels=LTX2_AUDIO_TOKEN,
        audio_out_channels=LTX2_AUDIO_TOKEN,
        audio_num_attention_heads=2,
        audio_attention_head_dim=width // 4,
        audio_cross_attention_dim=width // 2,
        audio_sampling_rate=16000,
        audio_hop_length=160,
        audio_scale_factor=4,
        num_layers=2,
        caption_channels=LTX2_TEXT_WIDTH,
        rope_double_precision=False,
        rope_type="split",
    )


def _ltx2_connectors():  # noqa: ANN202
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    return LTX2TextConnectors(
        caption_channels=LTX2_TEXT_WIDTH,
        text_proj_in_factor=LTX2_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32,
        rope_double_precision=False,
        rope_type="split",
    )


def _ltx2_audio_vae():  # noqa: ANN202
    from diffusers import AutoencoderKLLTX2Audio

    return AutoencoderKLLTX2Audio(
        base_channels=LTX2_AUDIO_TOKEN,
        output_channels=2,
        ch_mult=(1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=LTX2_AUDIO_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=LTX2_MEL_BINS,
    )


def _ltx2_vocoder():  # noqa: ANN202
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    return LTX2Vocoder(
        in_channels=2 * LTX2_MEL_BINS,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=400,
    )


# ---------------------------------------------------------------- MiniMax-H3
H3_VIDEO_CHANNELS, H3_AUDIO_CHANNELS, H3_TEXT_WIDTH, H3_TEXT_LAYERS = 4, 8, 16, 4
H3_WIDTH = 32
"""The transformer's hidden width (2 heads; a feed-forward twice as wide)."""
H3_CLIP = {"height": 32, "width": 32, "num_frames": 22, "text_encoder_layer": 2, "max_sequence_length": 96}
"""22 frames: the smallest clip the video VAE decodes (17 + 5 -> 7 latent frames), 8 x 8 latents."""


def tiny_h3_components(seed: int = 0, width: int = H3_WIDTH) -> dict[str, Any]:
    """Random-init H3 components (transformer `width` wide, at least 12, even), by folder name."""
    from diffusers import MiniMaxH3Scheduler

    if width % 2 or width < 12:
        raise ValueError(f"width {width}: the H3 transformer's width must be even and at least 12")
    tokenizer = _h3_tokenizer()
    torch.manual_seed(seed)
    text_encoder = _h3_text_encoder(len(tokenizer))
    models = _h3_models(width)  # created after the text encoder: the default's weights stay as they were
    return {
        **models,
        "text_encoder": text_encoder,
        "tokenizer": tokenizer,
        "scheduler": MiniMaxH3Scheduler(shift=12.0),
    }


def tiny_h3_conditioner(seed: int = 0) -> dict[str, Any]:
    """The tiny Qwen3-VL conditioner and its tokenizer alone, by folder name (a stand-in where the
    conditioner takes no part, such as a trace of the decode)."""
    tokenizer = _h3_tokenizer()
    torch.manual_seed(seed)
    return {"text_encoder": _h3_text_encoder(len(tokenizer)), "tokenizer": tokenizer}


def save_tiny_h3(path: Path, seed: int = 0, width: int = H3_WIDTH) -> Path:
    """The tiny components as component folders under `path`; returns `path`."""
    for name, component in tiny_h3_components(seed, width).items():
        component.save_pretrained(path / name)
    return path


def _h3_tokenizer():  # noqa: ANN202
    from transformers import Qwen2TokenizerFast

    words = ["<|endoftext|>", "<unk>", *string.ascii_lowercase, *string.digits, "\u0120"]
    return Qwen2TokenizerFast(
        vocab={w: i for i, w in enumerate(words)}, merges=[], unk_token="<unk>", eos_token="<|endoftext|>"
    )


def _h3_text_encoder(vocab: int):  # noqa: ANN202
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = {
        "vocab_size": vocab + 4,
        "hidden_size": H3_TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": H3_TEXT_LAYERS,
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
    return Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=text, vision_config=vision, **special)
    ).eval()


def _h3_models(width: int) -> dict[str, Any]:
    """The transformer and the two VAEs, created in this order (after the text encoder)."""
    from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

    transformer = MiniMaxH3Transformer3DModel(
        num_attention_heads=2,
        attention_head_dim=width // 2,  # >= 6 x rope_freq_dim
        hidden_size=width,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=2 * width,
        in_channels=H3_VIDEO_CHANNELS,
        audio_in_channels=H3_AUDIO_CHANNELS,
        patch_size=(1, 2, 2),
        text_dim=H3_TEXT_WIDTH,
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=H3_VIDEO_CHANNELS,
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
        latent_channels=H3_AUDIO_CHANNELS,
        num_attention_heads=2,
        decoder_dim=128,
        decoder_rates=(5, 5, 2, 2, 2, 2, 2),
        decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4),
        resblock_kernel_sizes=(3,),
        resblock_dilation_sizes=((1,),),
        latents_mean=[0.05 * i for i in range(H3_AUDIO_CHANNELS)],
        latents_std=[1.0 + 0.1 * i for i in range(H3_AUDIO_CHANNELS)],
    )
    return {"transformer": transformer, "vae": vae, "audio_vae": audio_vae}


# ---------------------------------------------------------------- a reward for both families
class AudioVideoLevel:
    """A reward that needs both streams: mean brightness plus mean loudness, clamped to [0, 1]."""

    def score(self, media: Any, prompts: list[str]) -> RewardOutput:
        level = media.video.mean(dim=(1, 2, 3, 4)) + media.audio.abs().mean(dim=(1, 2))
        return RewardOutput(level.clamp(0, 1), {})


AV_LEVEL_NAME = "tiny_av_level"
AV_LEVEL_PLUGIN = f"""
from omni_diffusion_rl.benchmarks.tiny_families import AudioVideoLevel
from omni_diffusion_rl.registry import rewards

rewards.register("{AV_LEVEL_NAME}")(AudioVideoLevel)
"""
"""AudioVideoLevel as a reward.plugins file (registered as AV_LEVEL_NAME) for launched processes."""


def write_av_level_plugin(folder: Path) -> Path:
    """AV_LEVEL_PLUGIN written into `folder`; the file's path (for reward.plugins)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{AV_LEVEL_NAME}.py"
    path.write_text(AV_LEVEL_PLUGIN, encoding="utf-8")
    return path
