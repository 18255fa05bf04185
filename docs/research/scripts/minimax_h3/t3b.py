import torch
from peft import LoraConfig
from tiny import *
torch.manual_seed(0)
tr=tiny_transformer(); tr.requires_grad_(False)
tr.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=True,
     target_modules=r"transformer_blocks\.\d+\.(attn\.(to_q|to_k|to_v|to_out\.0)|ff\.net\.(0\.proj|2))"))
B,C,F,H,W=2,VIDEO_C,7,8,8; S,T,L=2,10,5
xv=torch.randn(B,C,F,H,W); xa=torch.randn(B,S,AUDIO_C,T); txt=torch.randn(B,L,TEXT_DIM)
opt=torch.optim.AdamW([p for p in tr.parameters() if p.requires_grad], lr=1e-2)
tr.enable_gradient_checkpointing()
with torch.no_grad(): base=tr(**pack_inputs(xv,xa,txt,0.3,0.6)).sample.clone()
for step in range(3):
    opt.zero_grad()
    vv,aa=unpack_output(tr(**pack_inputs(xv,xa,txt,0.3,0.6)),xv.shape,xa.shape)
    loss=(vv**2).mean()+(aa**2).mean(); loss.backward()
    gA=sum(p.grad.abs().sum().item() for n,p in tr.named_parameters() if p.requires_grad and "lora_A" in n)
    gB=sum(p.grad.abs().sum().item() for n,p in tr.named_parameters() if p.requires_grad and "lora_B" in n)
    print(f"step {step} loss {loss.item():.5f} |gradA| {gA:.3e} |gradB| {gB:.3e}")
    opt.step()
with torch.no_grad():
    a=tr(**pack_inputs(xv,xa,txt,0.3,0.6)).sample
    b=tr(**pack_inputs(xv,xa,txt,0.3,0.6), attention_kwargs={"scale":0.0}).sample
print("after training: lora delta", (a-base).abs().max().item(), " scale=0 recovers base:", torch.allclose(b,base,atol=1e-5))
print("frozen base grads None:", all(p.grad is None for n,p in tr.named_parameters() if not p.requires_grad))
print("trainable", sum(p.numel() for p in tr.parameters() if p.requires_grad), "/", sum(p.numel() for p in tr.parameters()))
