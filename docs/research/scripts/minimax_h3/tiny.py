"""Tiny random-init MiniMax-H3 components + packing helpers (verified on CPU, diffusers 0.42.1)."""
import math
import numpy as np
import torch
from diffusers import AutoencoderKLMiniMaxH3, AutoencoderKLMiniMaxH3Audio, MiniMaxH3Transformer3DModel

VIDEO_C, AUDIO_C, TEXT_DIM = 4, 8, 16


def tiny_transformer(**kw):
    cfg = dict(
        num_attention_heads=2,
        attention_head_dim=16,      # must be >= 2*3*rope_freq_dim (12 here); rest passes through un-rotated
        hidden_size=32,
        num_layers=2,
        num_refiner_layers=1,
        ffn_dim=64,
        in_channels=VIDEO_C,        # = video VAE latent_channels
        audio_in_channels=AUDIO_C,  # = audio VAE latent_channels
        patch_size=(1, 2, 2),
        text_dim=TEXT_DIM,          # real: 5120 (Qwen3-VL hidden_states[50])
        freq_dim=32,
        time_embed_hidden_dim=32,
        time_embed_dim=16,
        rope_freq_dim=2,
    )
    cfg.update(kw)
    return MiniMaxH3Transformer3DModel(**cfg)


def tiny_video_vae(**kw):
    # keeps the real temporal geometry (x4 temporal, clip_length 17, token_drop 3); spatial x4 instead of x16
    cfg = dict(
        latent_channels=VIDEO_C,
        block_out_channels=(8, 8),
        layers_per_block=1,
        # a level that downsamples time but not space SHRINKS space by 2 (no spatial pad on that conv):
        # pair every temporal x2 with a spatial x2 (the real config does: (2,2,2,2,1,1) / (1,2,2,1,1,1))
        spatial_downsample_factors=(2, 2),
        temporal_downsample_factors=(2, 2),
        norm_num_groups=4,
        decoder_num_layers=1,
        decoder_num_attention_heads=1,
        decoder_attention_head_dim=8,    # int(8 * rope_dim_ratio 0.75) = 6 must be divisible by 6
        decoder_num_register_tokens=1,
        decoder_ffn_mult=1,
        latents_mean=(0.0,) * VIDEO_C,
        latents_std=(1.0,) * VIDEO_C,
    )
    cfg.update(kw)
    return AutoencoderKLMiniMaxH3(**cfg)


def tiny_audio_vae(faithful_hop=False, **kw):
    if faithful_hop:  # real hop 800 -> 40 latents/s at 32 kHz
        cfg = dict(encoder_dim=2, encoder_rates=(2, 4, 4, 5, 5), latent_dim=16, latent_channels=AUDIO_C,
                   num_attention_heads=2, decoder_dim=128, decoder_rates=(5, 5, 2, 2, 2, 2, 2),
                   decoder_kernel_sizes=(9, 9, 4, 4, 4, 4, 4), resblock_kernel_sizes=(3,),
                   resblock_dilation_sizes=((1,),))
    else:             # hop 4: smallest sensible
        cfg = dict(encoder_dim=2, encoder_rates=(2, 2), latent_dim=16, latent_channels=AUDIO_C,
                   num_attention_heads=2, decoder_dim=8, decoder_rates=(2, 2), decoder_kernel_sizes=(4, 4),
                   resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),))
    cfg.update(latents_mean=[0.0] * AUDIO_C, latents_std=[1.0] * AUDIO_C)
    cfg.update(kw)
    return AutoencoderKLMiniMaxH3Audio(**cfg)


# ---------------------------------------------------------------------------------------------------------------
# Packing: reproduces MiniMaxH3PrepareLayoutStep.build_packed_sequence (t2va, no keyframes) +
# MiniMaxH3SetTimestepsStep.build_row_timesteps + patchify_video_latents, but batched.
# Layout: [text | target audio (channel-major) | target video (frame-major, row-major patches)]
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2
_ROPE_FRAME_RESCALE, _ROPE_FRAMES_PER_LATENT, _ROPE_SPATIAL_SCALE = 5.0 / 3.0, (1, 4, 4, 4, 4), 32


def _spatial_grid(dim, patch, sqrt_area):
    ratio = dim / sqrt_area
    left = (1.0 - ratio) / 2.0
    return torch.from_numpy(np.linspace(left, left + ratio, dim // patch, endpoint=False) * _ROPE_SPATIAL_SCALE)


def pack_inputs(video_latents, audio_latents, text_embeddings, t_video, t_audio, patch_size=(1, 2, 2),
                text_token_tags=None):
    """
    video_latents:   (B, C_v, F, H, W)   normalized video latents x_t (VAE latents, (z-mean)/std)
    audio_latents:   (B, S, C_a, T)      normalized audio latents x_t, S = stereo channels (2 for real H3; any S>=1)
    text_embeddings: (B, L, text_dim)
    t_video, t_audio: python floats / 0-d tensors in H3 convention: t in [0,1], t=1 CLEAN, t=0 pure noise
                      (t = 1 - sigma). Shared by the whole batch (the model has no per-item timestep).
    returns kwargs for MiniMaxH3Transformer3DModel.forward
    """
    B, C, F, H, W = video_latents.shape
    pt, ph, pw = patch_size
    _, S, Ca, T = audio_latents.shape
    L = text_embeddings.shape[1]
    # video rows: (B, F*H/2*W/2, C*pt*ph*pw), frame-major then row-major; channel-major inside a patch
    v = video_latents.reshape(B, C, F // pt, pt, H // ph, ph, W // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    video_rows = v.reshape(B, -1, C * pt * ph * pw)
    # audio rows: channel-major (stereo channel 0's T latents, then channel 1's), each row = C_a features
    audio_rows = audio_latents.permute(0, 1, 3, 2).reshape(B, S * T, Ca)
    n_v, n_a = video_rows.shape[1], audio_rows.shape[1]
    seq = L + n_a + n_v
    a0, v0 = L, L + n_a

    pos = torch.zeros(seq, 3, dtype=torch.float64)
    pos[:L, 0] = torch.arange(L, dtype=torch.float64)               # text: (i, 0, 0)
    sqrt_area = math.sqrt(H * W)
    hg, wg = _spatial_grid(H, ph, sqrt_area), _spatial_grid(W, pw, sqrt_area)
    frame_grid = torch.stack([g.reshape(-1) for g in torch.meshgrid(hg, wg, indexing="ij")], -1)
    # audio: t = L + latent index (1 unit = 1/40 s); h = 0; w pinned to width-grid extremes per stereo channel
    pos[a0:v0, 0] = (L + torch.arange(T, dtype=torch.float64)).repeat(S)
    wcols = [float(wg[0]), float(wg[-1])]
    pos[a0:v0, 2] = torch.cat([torch.full((T,), wcols[min(s, 1)], dtype=torch.float64) for s in range(S)])
    # video: t = L + cumsum(5/3 * (1,4,4,4,4)...) (non-uniform), (h, w) aspect-normalized grid * 32
    spans = torch.tensor([_ROPE_FRAME_RESCALE * _ROPE_FRAMES_PER_LATENT[i % 5] for i in range(F // pt)],
                         dtype=torch.float64)
    ftime = L + torch.cat([torch.zeros(1, dtype=torch.float64), spans[:-1].cumsum(0)])
    vp = torch.empty(F // pt, frame_grid.shape[0], 3, dtype=torch.float64)
    vp[:, :, 0] = ftime[:, None]
    vp[:, :, 1:] = frame_grid[None]
    pos[v0:] = vp.reshape(-1, 3)

    text_indices = torch.arange(L)
    audio_indices = torch.arange(a0, v0)
    video_indices = torch.arange(v0, seq)
    tags = torch.empty(seq, dtype=torch.long)
    tags[text_indices] = TEXT_TAG if text_token_tags is None else text_token_tags
    tags[audio_indices] = AUDIO_TAG
    tags[video_indices] = VIDEO_TAG

    # per-row timesteps: text rows inherit the video timestep (pipeline convention)
    row_t = torch.full((seq,), float(t_video), dtype=torch.float32)
    row_t[audio_indices] = float(t_audio)
    timestep, timestep_indices = torch.unique(row_t, sorted=True, return_inverse=True)

    dev = video_latents.device
    return dict(
        hidden_states=video_rows, audio_hidden_states=audio_rows, encoder_hidden_states=text_embeddings,
        timestep=timestep.to(dev), timestep_indices=timestep_indices.to(dev), token_tags=tags.to(dev),
        position_ids=pos.to(dev), video_indices=video_indices.to(dev), audio_indices=audio_indices.to(dev),
        text_indices=text_indices.to(dev),
    )


def unpack_output(output, video_shape, audio_shape, patch_size=(1, 2, 2)):
    """output: MiniMaxH3TransformerOutput or (sample, audio_sample) tuple.
    Returns (video_velocity (B,C,F,H,W), audio_velocity (B,S,C_a,T)) in the H3 convention
    (data-ward: v = x0 - noise; x0_hat = x_t + (1 - t) * v)."""
    if isinstance(output, tuple):
        vid, aud = output
    else:
        vid, aud = output.sample, output.audio_sample
    B, C, F, H, W = video_shape
    _, S, Ca, T = audio_shape
    pt, ph, pw = patch_size
    v = vid.reshape(B, F // pt, H // ph, W // pw, C, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    video_v = v.reshape(B, C, F, H, W)
    audio_v = aud.reshape(B, S, T, Ca).permute(0, 1, 3, 2)
    return video_v, audio_v
