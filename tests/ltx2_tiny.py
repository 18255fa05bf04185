"""A tiny random-init LTX2Pipeline (every component a few thousand parameters, no download), sized so
that every width the pipeline wires together agrees (see docs/research/ltx2_pipeline.md)."""

from __future__ import annotations

import string

import torch

TEXT_WIDTH, TEXT_LAYERS = 16, 2  # Gemma hidden size = caption channels; connectors read layers + 1
VIDEO_CHANNELS, AUDIO_CHANNELS, MEL_BINS = 4, 2, 8
AUDIO_TOKEN = AUDIO_CHANNELS * (MEL_BINS // 4)  # transformer audio_in_channels = audio VAE base_channels
CLIP = {"height": 32, "width": 32, "num_frames": 9, "frame_rate": 25.0, "max_sequence_length": 16}


def tiny_ltx2_pipeline(seed: int = 0):  # noqa: ANN201 - diffusers is imported lazily
    from diffusers import (
        AutoencoderKLLTX2Audio,
        AutoencoderKLLTX2Video,
        FlowMatchEulerDiscreteScheduler,
        LTX2Pipeline,
        LTX2VideoTransformer3DModel,
    )
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

    words = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *string.ascii_lowercase, *string.digits, "\u2581"]
    tokenizer = GemmaTokenizer(vocab={w: i for i, w in enumerate(words)}, merges=[])
    tokenizer.model_max_length = 64
    torch.manual_seed(seed)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": TEXT_WIDTH,
        "intermediate_size": 32,
        "num_hidden_layers": TEXT_LAYERS,
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
    text_encoder = Gemma3ForConditionalGeneration(config).eval()
    vae = AutoencoderKLLTX2Video(
        in_channels=3,
        out_channels=3,
        latent_channels=VIDEO_CHANNELS,
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
    ratio_t, ratio_s = vae.temporal_compression_ratio, vae.spatial_compression_ratio
    transformer = LTX2VideoTransformer3DModel(
        in_channels=VIDEO_CHANNELS,
        out_channels=VIDEO_CHANNELS,
        patch_size=1,
        patch_size_t=1,
        num_attention_heads=2,
        attention_head_dim=8,
        cross_attention_dim=16,
        vae_scale_factors=(ratio_t, ratio_s, ratio_s),
        audio_in_channels=AUDIO_TOKEN,
        audio_out_channels=AUDIO_TOKEN,
        audio_num_attention_heads=2,
        audio_attention_head_dim=4,
        audio_cross_attention_dim=8,
        audio_sampling_rate=16000,
        audio_hop_length=160,
        audio_scale_factor=4,
        num_layers=2,
        caption_channels=TEXT_WIDTH,
        rope_double_precision=False,
        rope_type="split",
    )
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_WIDTH,
        text_proj_in_factor=TEXT_LAYERS + 1,
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
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=AUDIO_TOKEN,
        output_channels=2,
        ch_mult=(1, 1, 1),
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=32,
        latent_channels=AUDIO_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        dropout=0.0,
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=MEL_BINS,
    )
    vocoder = LTX2Vocoder(
        in_channels=2 * MEL_BINS,
        hidden_channels=32,
        out_channels=2,
        upsample_kernel_sizes=[4, 4],
        upsample_factors=[2, 2],
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=400,
    )
    pipeline = LTX2Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=vae,
        audio_vae=audio_vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        connectors=connectors,
        transformer=transformer,
        vocoder=vocoder,
    )
    pipeline.set_progress_bar_config(disable=True)
    return pipeline


GUIDANCE_OFF = {
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
