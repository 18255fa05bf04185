import torch, transformers
from tiny import *
print("transformers", transformers.__version__)
torch.manual_seed(0)
tr=tiny_transformer()
B,C,F,H,W=1,VIDEO_C,7,8,8; S,T,L=2,10,5
xv=torch.randn(B,C,F,H,W); xa=torch.randn(B,S,AUDIO_C,T); txt=torch.randn(B,L,TEXT_DIM)
with torch.no_grad(): ref=tr(**pack_inputs(xv,xa,txt,0.3,0.6))
# mixed precision as from_pretrained(torch_dtype=bf16) would leave it
trb=tiny_transformer(); trb.load_state_dict(tr.state_dict()); trb.to(torch.bfloat16)
for n,m in trb.named_modules():
    if any(k in n for k in MiniMaxH3Transformer3DModel._keep_in_fp32_modules) and n.count('.')==0: m.float()
print({n:p.dtype for n,p in trb.named_parameters() if n in ["proj_in.weight","time_embedder.linear_1.weight","transformer_blocks.0.attn.to_q.weight","proj_out.weight"]})
with torch.no_grad(): o=trb(**pack_inputs(xv,xa,txt.bfloat16(),0.3,0.6))
print("bf16 mixed: out dtype", o.sample.dtype, "max abs diff vs fp32", (o.sample-ref.sample).abs().max().item(), "ref scale", ref.sample.abs().mean().item())
# mono audio (S=1), odd sizes
with torch.no_grad(): o=tr(**pack_inputs(torch.randn(1,C,3,4,6),torch.randn(1,1,AUDIO_C,3),torch.randn(1,2,TEXT_DIM),0.1,0.1))
print("mono/odd ok", tuple(o.sample.shape), tuple(o.audio_sample.shape))
# zero audio rows?
try:
    with torch.no_grad(): o=tr(**pack_inputs(torch.randn(1,C,3,4,6),torch.randn(1,1,AUDIO_C,0),torch.randn(1,2,TEXT_DIM),0.1,0.1))
    print("zero audio rows ok", tuple(o.audio_sample.shape))
except Exception as e: print("zero audio rows ERR", type(e).__name__, str(e)[:100])
# text padding with zeros changes the result (no mask available)
with torch.no_grad():
    o1=tr(**pack_inputs(xv,xa,txt,0.3,0.6)); o2=tr(**pack_inputs(xv,xa,torch.cat([txt,torch.zeros(1,3,TEXT_DIM)],1),0.3,0.6))
print("zero-padding text changes video out by", (o1.sample-o2.sample).abs().max().item())
# real-size sequence length
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import video_latent_num_frames, audio_latent_num_frames, align_num_frames
nf=align_num_frames(121,17,5); lf=video_latent_num_frames(nf,17,5); na=audio_latent_num_frames(nf)
print("real: frames",nf,"latent frames",lf,"audio latents/ch",na,"video rows @768x1344:", lf*(768//16//2)*(1344//16//2), "audio rows", 2*na)
