"""Reproduce LTX2Pipeline's denoising with a hand-written Euler loop calling the transformer directly."""
import copy, sys, numpy as np, torch
torch.set_num_threads(1)
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.utils.torch_utils import randn_tensor
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift
from tiny_ltx2 import make_pipeline, NO_GUIDANCE

LTX_LIKE_SCHED = dict(use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05, base_image_seq_len=1024,
                      max_image_seq_len=4096, shift_terminal=0.1)

def run(sched_kwargs, use_cross_timestep, steps=2, H=32, W=32, F=9, fps=25.0, seed=0, prompt="a robot dancing"):
    pipe = make_pipeline()
    pipe.scheduler = FlowMatchEulerDiscreteScheduler(**sched_kwargs)
    common = dict(height=H, width=W, num_frames=F, frame_rate=fps, num_inference_steps=steps,
                  max_sequence_length=16, use_cross_timestep=use_cross_timestep, **NO_GUIDANCE)
    # ---- 1. the pipeline, returning (denormalised, unpacked) latents
    v_ref, a_ref = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="latent",
                        return_dict=False, **common)

    # ---- 2. our own loop
    tr, vae, avae = pipe.transformer, pipe.vae, pipe.audio_vae
    with torch.no_grad():
        pe, pm, _, _ = pipe.encode_prompt(prompt, do_classifier_free_guidance=False, max_sequence_length=16)
        v_ctx, a_ctx, ctx_mask = pipe.connectors(pe, pm, padding_side=pipe.tokenizer.padding_side)
    if seed == 0 and use_cross_timestep:
        print("gemma packed prompt_embeds", tuple(pe.shape), "mask", tuple(pm.shape),
              "-> connectors: video", tuple(v_ctx.shape), "audio", tuple(a_ctx.shape), "mask", tuple(ctx_mask.shape), ctx_mask.dtype)

    lf = (F - 1) // pipe.vae_temporal_compression_ratio + 1
    lh, lw = H // pipe.vae_spatial_compression_ratio, W // pipe.vae_spatial_compression_ratio
    a_len = round(F / fps * avae.config.sample_rate / avae.config.mel_hop_length / avae.temporal_compression_ratio)
    a_mel = avae.config.mel_bins // avae.mel_compression_ratio
    g = torch.Generator().manual_seed(seed)     # same draw order as the pipeline: video first, then audio
    v0 = randn_tensor((1, tr.config.in_channels, lf, lh, lw), generator=g, dtype=torch.float32)
    a0 = randn_tensor((1, avae.config.latent_channels, a_len, a_mel), generator=g, dtype=torch.float32)
    x_v = pipe._pack_latents(v0, tr.config.patch_size, tr.config.patch_size_t)   # [B, F*H*W, C]
    x_a = pipe._pack_audio_latents(a0)                                           # [B, L, C*M]
    if seed == 0 and use_cross_timestep:
        print("video noise", tuple(v0.shape), "-> packed", tuple(x_v.shape), "| audio noise", tuple(a0.shape), "-> packed", tuple(x_a.shape))

    sch = FlowMatchEulerDiscreteScheduler(**sched_kwargs)
    sig = np.linspace(1.0, 1 / steps, steps)
    mu = calculate_shift(x_v.shape[1], sch.config.base_image_seq_len, sch.config.max_image_seq_len,
                         sch.config.base_shift, sch.config.max_shift)
    sch.set_timesteps(sigmas=sig, mu=mu)
    sigmas, timesteps = sch.sigmas, sch.timesteps      # sigmas has a trailing 0
    print(f"sched={'ltx-like' if sched_kwargs else 'default'} mu={mu:.4f} sigmas={[round(s,4) for s in sigmas.tolist()]} timesteps={[round(t,2) for t in timesteps.tolist()]}")

    v_coords = tr.rope.prepare_video_coords(1, lf, lh, lw, x_v.device, fps=fps)
    a_coords = tr.audio_rope.prepare_audio_coords(1, a_len, x_a.device)
    with torch.no_grad():
        for i in range(steps):
            t = (sigmas[i] * 1000).expand(1)           # == scheduler.timesteps[i]; model expects sigma*1000
            vel_v, vel_a = tr(
                hidden_states=x_v, audio_hidden_states=x_a,
                encoder_hidden_states=v_ctx, audio_encoder_hidden_states=a_ctx,
                timestep=t, sigma=t, encoder_attention_mask=ctx_mask, audio_encoder_attention_mask=ctx_mask,
                num_frames=lf, height=lh, width=lw, fps=fps, audio_num_frames=a_len,
                video_coords=v_coords, audio_coords=a_coords, use_cross_timestep=use_cross_timestep,
                return_dict=False)
            dt = sigmas[i + 1] - sigmas[i]
            x_v = x_v + dt * vel_v.float()
            x_a = x_a + dt * vel_a.float()
    v_mine = pipe._denormalize_latents(pipe._unpack_latents(x_v, lf, lh, lw, 1, 1), vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
    a_mine = pipe._unpack_audio_latents(pipe._denormalize_audio_latents(x_a, avae.latents_mean, avae.latents_std), a_len, a_mel)
    dv = (v_mine - v_ref).abs().max().item(); da = (a_mine - a_ref).abs().max().item()
    print(f"  use_cross_timestep={use_cross_timestep}: video latents {tuple(v_ref.shape)} maxabs diff {dv:.3e} | audio latents {tuple(a_ref.shape)} maxabs diff {da:.3e}")

    # ---- 3. decode ourselves and compare against the pipeline's decoded outputs
    if seed == 0 and use_cross_timestep and not sched_kwargs:
        out = pipe(prompt=prompt, generator=torch.Generator().manual_seed(seed), output_type="pt", **common)
        with torch.no_grad():
            vid = vae.decode(v_mine, None, return_dict=False)[0]                # [B,3,F,H,W] in ~[-1,1]
            vid = pipe.video_processor.postprocess_video(vid, output_type="pt")  # [B,F,3,H,W] in [0,1]
            mel = avae.decode(a_mine, return_dict=False)[0]                      # [B,2,T_mel,mel_bins]
            wav = pipe.vocoder(mel)                                              # [B,2,T_mel*prod(upsample)]
        print("  decode: vae out", tuple(vae.decode(v_mine, None).sample.shape), "frames", tuple(vid.shape),
              "diff", (vid - out.frames).abs().max().item())
        print("  decode: mel", tuple(mel.shape), "wav", tuple(wav.shape), "diff", (wav - out.audio).abs().max().item())
    return dv, da

for sk in ({}, LTX_LIKE_SCHED):
    for uct in (True, False):
        run(sk, uct)
run({}, True, steps=4, seed=3, H=64, W=32, F=17)
