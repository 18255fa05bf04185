"""peft LoRA on the tiny LTX2 transformer -> save in diffusers convention -> LTX2Pipeline.load_lora_weights."""
import os, shutil, torch
torch.set_num_threads(1)
from peft import LoraConfig, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file
from diffusers import LTX2Pipeline
from tiny_ltx2 import make_pipeline, NO_GUIDANCE

OUT = "/tmp/ltx2_research/lora_out"
shutil.rmtree(OUT, ignore_errors=True)
TARGETS = [  # suffix match: "attn1.to_q" does NOT match "audio_attn1.to_q" (peft needs a '.' boundary)
    *(f"{a}.{p}" for a in ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
      for p in ("to_q", "to_k", "to_v", "to_out.0")),
]
cfg = LoraConfig(r=4, lora_alpha=8, init_lora_weights=True, target_modules=TARGETS)

def call_kwargs():
    return dict(prompt="a robot dancing", height=32, width=32, num_frames=9, frame_rate=25.0, num_inference_steps=2,
                max_sequence_length=16, output_type="latent", return_dict=False,
                generator=torch.Generator().manual_seed(0), **NO_GUIDANCE)

# --- A: diffusers-native: transformer.add_adapter (PeftAdapterMixin) ------------------------------------------
pipe = make_pipeline()
base_v, base_a = pipe(**call_kwargs())
pipe.transformer.add_adapter(cfg, adapter_name="default")
n_lora = sum(1 for n, _ in pipe.transformer.named_modules() if n.endswith("lora_A"))
print("LoRA-wrapped Linear modules:", n_lora, "(= 2 layers * 6 attns * 4 projs)")
with torch.no_grad():  # make the adapter non-trivial (lora_B is zero-init)
    for n, p in pipe.transformer.named_parameters():
        if "lora_B" in n:
            p.normal_(std=0.5)
print("trainable params:", sum(p.numel() for p in pipe.transformer.parameters() if p.requires_grad))
lora_v, lora_a = pipe(**call_kwargs())
print("LoRA changes output:", (lora_v - base_v).abs().max().item(), (lora_a - base_a).abs().max().item())

sd = get_peft_model_state_dict(pipe.transformer, adapter_name="default")
print("peft state-dict key example:", next(iter(sd)))
LTX2Pipeline.save_lora_weights(OUT, transformer_lora_layers=sd,
                               transformer_lora_adapter_metadata=cfg.to_dict())
saved = load_file(os.path.join(OUT, "pytorch_lora_weights.safetensors"))
print("saved file:", os.listdir(OUT), "| key example:", sorted(saved)[0], "| n keys", len(saved))

# fresh pipeline (same base seed) -> load_lora_weights
pipe2 = make_pipeline()
pipe2.load_lora_weights(OUT, adapter_name="rl")
v2, a2 = pipe2(**call_kwargs())
print("fresh pipe + load_lora_weights vs trained: ", (v2 - lora_v).abs().max().item(), (a2 - lora_a).abs().max().item())

# without metadata: alpha is not recoverable from the tensors -> check whether scale differs
OUT2 = OUT + "_nometa"; shutil.rmtree(OUT2, ignore_errors=True)
LTX2Pipeline.save_lora_weights(OUT2, transformer_lora_layers=sd)
pipe3 = make_pipeline(); pipe3.load_lora_weights(OUT2, adapter_name="rl")
v3, a3 = pipe3(**call_kwargs())
print("no-metadata save (alpha=8,r=4) vs trained:", (v3 - lora_v).abs().max().item())
print("scaling used after no-metadata load:", pipe3.transformer.transformer_blocks[0].attn1.to_q.scaling)

# dict route + set_adapters/scale/disable/fuse
pipe4 = make_pipeline(); pipe4.load_lora_weights({f"transformer.{k}": v for k, v in sd.items()}, adapter_name="rl")
pipe4.transformer.transformer_blocks[0].attn1.to_q.scaling  # noqa
v4, _ = pipe4(**call_kwargs())
print("load from in-memory dict {'transformer.'+k}: (alpha lost -> same as no-meta)", (v4 - v3).abs().max().item())
pipe2.set_adapters(["rl"], [0.0]); v5, _ = pipe2(**call_kwargs()); print("set_adapters weight 0 -> base:", (v5 - base_v).abs().max().item())
pipe2.set_adapters(["rl"], [1.0]); pipe2.fuse_lora(components=["transformer"]); pipe2.unload_lora_weights()
v6, _ = pipe2(**call_kwargs()); print("fuse_lora + unload -> still LoRA output:", (v6 - lora_v).abs().max().item())

# --- B: plain peft get_peft_model wrapper -> keys need stripping --------------------------------------------
tr = make_pipeline().transformer
pm = get_peft_model(tr, LoraConfig(r=4, lora_alpha=4, target_modules=TARGETS))
raw = pm.state_dict()
print("get_peft_model raw key example:", [k for k in raw if "lora_A" in k][0])
sd_b = get_peft_model_state_dict(pm)
print("get_peft_model_state_dict(PeftModel) key example:", next(iter(sd_b)))
