"""Tiny random-init LTX2Pipeline components (no downloads). Verified with diffusers 0.42.1 / transformers 5.24 / torch 2.13 CPU."""
import string

import torch
from transformers import Gemma3Config, Gemma3ForConditionalGeneration, GemmaTokenizer

from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.pipelines.ltx2 import LTX2TextConnectors
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

# ---- shared sizes -------------------------------------------------------------------------------------------
TEXT_HIDDEN = 16          # Gemma hidden_size == caption_channels == connector inner dim (heads*head_dim)
TEXT_LAYERS = 2           # connectors.text_proj_in_factor = TEXT_LAYERS + 1 (embeddings + each layer)
VIDEO_LATENT_C = 4        # video VAE latent_channels == transformer.in_channels/out_channels (patch_size=1)
AUDIO_LATENT_C = 2        # audio VAE latent_channels
MEL_BINS = 8              # audio VAE mel_bins; latent mel bins = MEL_BINS // 4 (hard-coded factor 4)
AUDIO_TOKEN_DIM = AUDIO_LATENT_C * (MEL_BINS // 4)  # == transformer.audio_in_channels == audio_vae.base_channels


def make_tokenizer():
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    chars = list(string.ascii_lowercase + string.digits + ".,!?'-") + ["\u2581"]
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = GemmaTokenizer(vocab=vocab, merges=[])
    tok.model_max_length = 64
    return tok


def make_text_encoder(vocab_size):
    cfg = Gemma3Config(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_HIDDEN, intermediate_size=32, num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=128,
            sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        ),
        vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           image_size=28, patch_size=14),
        mm_tokens_per_image=4,
    )
    return Gemma3ForConditionalGeneration(cfg).eval()


def make_components(seed=0, vae_patch=4, audio_ch_mult=(1, 1, 1), num_layers=2):
    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    text_encoder = make_text_encoder(len(tokenizer))

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=VIDEO_LATENT_C,
        block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1),
        spatio_temporal_scaling=(True,), decoder_spatio_temporal_scaling=(True,),
        decoder_inject_noise=(False, False), downsample_type=("spatiotemporal",),
        upsample_residual=(False,), upsample_factor=(1,),
        timestep_conditioning=False, patch_size=vae_patch, patch_size_t=1,
        encoder_causal=True, decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    st, ss = vae.temporal_compression_ratio, vae.spatial_compression_ratio

    torch.manual_seed(seed)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=VIDEO_LATENT_C, out_channels=VIDEO_LATENT_C, patch_size=1, patch_size_t=1,
        num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,      # cross_attention_dim == 2*8
        vae_scale_factors=(st, ss, ss),                                           # only used for RoPE coords
        audio_in_channels=AUDIO_TOKEN_DIM, audio_out_channels=AUDIO_TOKEN_DIM,
        audio_num_attention_heads=2, audio_attention_head_dim=4, audio_cross_attention_dim=8,  # == 2*4
        audio_sampling_rate=16000, audio_hop_length=160, audio_scale_factor=4,
        num_layers=num_layers, caption_channels=TEXT_HIDDEN,
        rope_double_precision=False, rope_type="split",
    )

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_HIDDEN, text_proj_in_factor=TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None,
        audio_connector_num_attention_heads=2, audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
        connector_rope_base_seq_len=32, rope_double_precision=False, rope_type="split",
    )

    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=AUDIO_TOKEN_DIM, output_channels=2, ch_mult=audio_ch_mult, num_res_blocks=1,
        attn_resolutions=None, in_channels=2, resolution=32, latent_channels=AUDIO_LATENT_C,
        norm_type="pixel", causality_axis="height", dropout=0.0, mid_block_add_attention=False,
        sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=MEL_BINS,
    )

    torch.manual_seed(seed)
    up = [2, 2]
    vocoder = LTX2Vocoder(
        in_channels=audio_vae.config.output_channels * MEL_BINS, hidden_channels=32, out_channels=2,
        upsample_kernel_sizes=[4, 4], upsample_factors=up, resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
        leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000 // 160 * up[0] * up[1],  # metadata only: mel fps (100) * total upsampling
    )

    scheduler = FlowMatchEulerDiscreteScheduler()  # plain defaults: shift=1, no dynamic shifting
    return dict(
        transformer=transformer, vae=vae, audio_vae=audio_vae, scheduler=scheduler, text_encoder=text_encoder,
        tokenizer=tokenizer, connectors=connectors, vocoder=vocoder,
    )


def make_pipeline(**kw):
    pipe = LTX2Pipeline(**make_components(**kw))
    pipe.set_progress_bar_config(disable=True)
    return pipe


# Call kwargs that switch off every guidance term (CFG, STG, modality isolation, rescale) -> 1 transformer pass/step.
NO_GUIDANCE = dict(
    guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, audio_stg_scale=0.0,
    modality_scale=1.0, audio_modality_scale=1.0, guidance_rescale=0.0, audio_guidance_rescale=0.0,
    spatio_temporal_guidance_blocks=None,
)
