import torch; torch.set_num_threads(1)
from diffusers import LTX2VideoTransformer3DModel
from tiny_ltx2 import make_components
comps = make_components()
cfg = dict(comps["transformer"].config); cfg["perturbed_attn"] = True; cfg.pop("_use_default_values", None)  # else from_config resets it!
tr = LTX2VideoTransformer3DModel.from_config(cfg)
print(tr.config.perturbed_attn, tr.transformer_blocks[1].perturbed_attn, type(tr.transformer_blocks[1].attn1.processor).__name__)
# scale_shift tables: gate_msa?
b = tr.transformer_blocks[1]
print("attn1 to_out weight abs mean", b.attn1.to_out[0].weight.abs().mean().item())
x = torch.randn(1, 80, 4); xa = torch.randn(1, 9, 4); e = torch.randn(1, 16, 16); m = torch.ones(1, 16)
kw = dict(hidden_states=x, audio_hidden_states=xa, encoder_hidden_states=e, audio_encoder_hidden_states=e, timestep=torch.tensor([500.]), sigma=torch.tensor([500.]),
          encoder_attention_mask=m, audio_encoder_attention_mask=m, num_frames=5, height=4, width=4, fps=25.0, audio_num_frames=9, return_dict=False)
with torch.no_grad():
    a = tr(**kw); s0 = tr(**kw, spatio_temporal_guidance_blocks=[0]); s1 = tr(**kw, spatio_temporal_guidance_blocks=[1])
print("stg block0 diff", (a[0]-s0[0]).abs().max().item(), (a[1]-s0[1]).abs().max().item(), "block1 diff", (a[0]-s1[0]).abs().max().item())
