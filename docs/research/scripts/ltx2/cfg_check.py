"""Reproduce the pipeline's full guidance (CFG + STG + modality isolation + rescale) in our own loop."""
import numpy as np, torch
torch.set_num_threads(1)
from diffusers import LTX2Pipeline, LTX2VideoTransformer3DModel
from diffusers.utils.torch_utils import randn_tensor
from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, rescale_noise_cfg
from tiny_ltx2 import make_components

comps = make_components()
# STG only does something when the transformer was built with perturbed_attn=True
cfg = dict(comps["transformer"].config); cfg["perturbed_attn"] = True; cfg.pop("_use_default_values", None)  # else from_config resets it!
torch.manual_seed(0); comps["transformer"] = LTX2VideoTransformer3DModel.from_config(cfg)
pipe = LTX2Pipeline(**comps); pipe.set_progress_bar_config(disable=True)
G = dict(guidance_scale=3.0, audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0, modality_scale=3.0,
         audio_modality_scale=3.0, guidance_rescale=0.7, audio_guidance_rescale=0.7, spatio_temporal_guidance_blocks=[1])
H = W = 32; F = 9; fps = 25.0; steps = 3; P = "a robot dancing"; N = "blurry"
ref_v, ref_a = pipe(prompt=P, negative_prompt=N, height=H, width=W, num_frames=F, frame_rate=fps, num_inference_steps=steps,
                    max_sequence_length=16, generator=torch.Generator().manual_seed(0), output_type="latent", return_dict=False, **G)

tr, avae = pipe.transformer, pipe.audio_vae
pe, pm, ne, nm = pipe.encode_prompt(P, N, do_classifier_free_guidance=True, max_sequence_length=16)
with torch.no_grad():
    cv, ca, cmask = pipe.connectors(torch.cat([ne, pe]), torch.cat([nm, pm]), padding_side="left")
lf, lh, lw = (F - 1) // 2 + 1, H // 8, W // 8
al = round(F / fps * 25); am = 2
g = torch.Generator().manual_seed(0)
xv = pipe._pack_latents(randn_tensor((1, 4, lf, lh, lw), generator=g, dtype=torch.float32))
xa = pipe._pack_audio_latents(randn_tensor((1, 2, al, am), generator=g, dtype=torch.float32))
sch = pipe.scheduler
sch.set_timesteps(sigmas=np.linspace(1.0, 1 / steps, steps), mu=calculate_shift(xv.shape[1], 256, 4096, 0.5, 1.15))
sig = sch.sigmas
vc = tr.rope.prepare_video_coords(1, lf, lh, lw, xv.device, fps=fps); ac = tr.audio_rope.prepare_audio_coords(1, al, xa.device)

def velo(v_ctx, a_ctx, mask, t, **kw):
    B = v_ctx.shape[0]
    return tr(hidden_states=xv.expand(B, -1, -1), audio_hidden_states=xa.expand(B, -1, -1), encoder_hidden_states=v_ctx,
              audio_encoder_hidden_states=a_ctx, timestep=t.expand(B), sigma=t.expand(B), encoder_attention_mask=mask,
              audio_encoder_attention_mask=mask, num_frames=lf, height=lh, width=lw, fps=fps, audio_num_frames=al,
              video_coords=vc.expand(B, -1, -1, -1), audio_coords=ac.expand(B, -1, -1, -1), use_cross_timestep=True,
              return_dict=False, **kw)

def guide(x, c, u, s, o, w, ws, wm, rescale, sigma):
    x0 = lambda v: x - sigma * v.float()
    c0 = x0(c); g = c0 + (w - 1) * (c0 - x0(u)) + ws * (c0 - x0(s)) + (wm - 1) * (c0 - x0(o))
    if rescale > 0: g = rescale_noise_cfg(g, c0, guidance_rescale=rescale)
    return (x - g) / sigma

with torch.no_grad():
    for i in range(steps):
        t = sig[i] * 1000
        (vu, vcnd), (au, acnd) = [o.chunk(2) for o in velo(cv, ca, cmask, t)]
        vs, as_ = velo(cv[1:], ca[1:], cmask[1:], t, spatio_temporal_guidance_blocks=[1])   # STG pass
        vo, ao = velo(cv[1:], ca[1:], cmask[1:], t, isolate_modalities=True)             # modality-isolated pass
        gv = guide(xv, vcnd, vu, vs, vo, 3.0, 1.0, 3.0, 0.7, sig[i])
        ga = guide(xa, acnd, au, as_, ao, 7.0, 1.0, 3.0, 0.7, sig[i])
        xv = xv + (sig[i + 1] - sig[i]) * gv; xa = xa + (sig[i + 1] - sig[i]) * ga
mv = pipe._unpack_latents(xv, lf, lh, lw); ma = pipe._unpack_audio_latents(xa, al, am)
print("full-guidance replica: video", (mv - ref_v).abs().max().item(), "audio", (ma - ref_a).abs().max().item())
with torch.no_grad():
    t = sig[0] * 1000
    a = velo(cv[1:], ca[1:], cmask[1:], t)[0]; b = velo(cv[1:], ca[1:], cmask[1:], t, spatio_temporal_guidance_blocks=[1])[0]
    c = velo(cv[1:], ca[1:], cmask[1:], t, isolate_modalities=True)[0]
print("STG pass differs from cond pass:", (a - b).abs().max().item(), "| modality-isolated differs:", (a - c).abs().max().item())
print("guided result differs from cond-only:", (ref_v.abs().max()).item())
