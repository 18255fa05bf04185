import torch; torch.set_num_threads(1)
from peft import LoraConfig
from tiny_ltx2 import make_pipeline, NO_GUIDANCE
# --- bf16 end to end
pipe = make_pipeline().to(torch.bfloat16)
out = pipe(prompt="a robot dancing", height=32, width=32, num_frames=9, frame_rate=25.0, num_inference_steps=2,
           max_sequence_length=16, output_type="pt", generator=torch.Generator().manual_seed(0), **NO_GUIDANCE)
print("bf16 pipeline ok:", out.frames.dtype, tuple(out.frames.shape), out.audio.dtype, tuple(out.audio.shape))
# mixed: text encoder fp32, transformer bf16 -> ?
pipe = make_pipeline(); pipe.transformer.to(torch.bfloat16)
try:
    pipe(prompt="a", height=32, width=32, num_frames=9, num_inference_steps=1, max_sequence_length=16, output_type="latent", **NO_GUIDANCE)
    print("fp32 text enc + bf16 transformer: ok")
except Exception as e:
    print("fp32 text enc + bf16 transformer FAILS:", type(e).__name__, str(e)[:120])
# --- gradients through the transformer with LoRA + gradient checkpointing
pipe = make_pipeline(); tr = pipe.transformer
tr.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
tr.enable_gradient_checkpointing(); tr.train()
with torch.no_grad():
    pe, pm, _, _ = pipe.encode_prompt("a robot", do_classifier_free_guidance=False, max_sequence_length=16)
    v_ctx, a_ctx, mask = pipe.connectors(pe, pm)
xv, xa, t = torch.randn(1, 80, 4), torch.randn(1, 9, 4), torch.tensor([700.0])
vv, va = tr(hidden_states=xv, audio_hidden_states=xa, encoder_hidden_states=v_ctx, audio_encoder_hidden_states=a_ctx,
            timestep=t, sigma=t, encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=5, height=4,
            width=4, fps=25.0, audio_num_frames=9, return_dict=False)
(vv.square().mean() + va.square().mean()).backward()
g = [p.grad.abs().sum().item() for n, p in tr.named_parameters() if "lora_B" in n]
print("grad ok: lora_B grads nonzero:", sum(x > 0 for x in g), "/", len(g), "| base grads:", sum(p.grad is not None for n, p in tr.named_parameters() if "lora" not in n))
