import time, torch
from peft import LoraConfig
from tiny import *
torch.manual_seed(0)
tr=tiny_transformer()
names=[n for n,_ in tr.named_modules()]
print([n for n in names if n.startswith("transformer_blocks.0") or n.startswith("token_refiner.refiner_blocks.0")])
print("top-level:", [n for n,_ in tr.named_children()])
tr.requires_grad_(False)
cfg=LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
               target_modules=["to_q","to_k","to_v","to_out.0"])
tr.add_adapter(cfg)
lora=[n for n,p in tr.named_parameters() if p.requires_grad]
print("n lora params tensors", len(lora), "includes refiner:", any("token_refiner" in n for n in lora))
print(lora[:4])
# restrict to main blocks only (exclude text refiner) with regex
tr2=tiny_transformer(); tr2.requires_grad_(False)
tr2.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian",
     target_modules=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"))
l2=[n for n,p in tr2.named_parameters() if p.requires_grad]
print("regex variant tensors", len(l2), "refiner?", any("token_refiner" in n for n in l2), "ff?", any(".ff." in n for n in l2))
B,C,F,H,W=2,VIDEO_C,7,8,8; S,T,L=2,10,5
xv=torch.randn(B,C,F,H,W); xa=torch.randn(B,S,AUDIO_C,T); txt=torch.randn(B,L,TEXT_DIM)
for gc in [False, True]:
    m=tr2
    if gc: m.enable_gradient_checkpointing()
    else: m.disable_gradient_checkpointing()
    print("gc flags: blocks", m.gradient_checkpointing, "refiner", m.token_refiner.gradient_checkpointing)
    m.zero_grad()
    out=m(**pack_inputs(xv,xa,txt,0.3,0.6))
    vv,aa=unpack_output(out,xv.shape,xa.shape)
    loss=(vv**2).mean()+(aa**2).mean(); loss.backward()
    g=[p.grad.abs().sum().item() for n,p in m.named_parameters() if p.requires_grad]
    print(f"gc={gc} loss {loss.item():.5f} all lora grads nonzero: {all(x>0 for x in g)} n={len(g)}")
# lora scale via attention_kwargs
with torch.no_grad():
    a=tr2(**pack_inputs(xv,xa,txt,0.3,0.6)).sample
    b=tr2(**pack_inputs(xv,xa,txt,0.3,0.6), attention_kwargs={"scale":0.0}).sample
    tr2.disable_adapters(); c=tr2(**pack_inputs(xv,xa,txt,0.3,0.6)).sample; tr2.enable_adapters()
print("scale=0 == adapters disabled:", torch.allclose(b,c,atol=1e-6), " lora changes output:", (a-c).abs().max().item())
print("VAE gc:", AutoencoderKLMiniMaxH3._supports_gradient_checkpointing, AutoencoderKLMiniMaxH3Audio._supports_gradient_checkpointing)
vae=tiny_video_vae(); vae.enable_gradient_checkpointing()
print("video vae gc set on decoder:", vae.decoder.gradient_checkpointing, [n for n,mm in vae.named_modules() if getattr(mm,'gradient_checkpointing',False)][:5])
try:
    tiny_audio_vae().enable_gradient_checkpointing()
except Exception as e: print("audio vae enable_gc:", type(e).__name__, e)
print("audio vae has enable_tiling:", hasattr(AutoencoderKLMiniMaxH3Audio,"enable_tiling"), "enable_slicing:", hasattr(AutoencoderKLMiniMaxH3Audio,"enable_slicing"))
# fused qkv?
try:
    tr3=tiny_transformer(); tr3.fuse_qkv_projections(); print("fuse_qkv ok", hasattr(tr3.transformer_blocks[0].attn,"to_qkv"))
except Exception as e: print("fuse_qkv:", type(e).__name__, e)
