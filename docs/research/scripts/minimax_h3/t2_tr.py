import time, torch, inspect
from tiny import *
torch.manual_seed(0)
tr=tiny_transformer().eval()
B,C,F,H,W = 2,VIDEO_C,7,8,8       # = video VAE latents of 22x32x32 frames
S,T = 2,10                        # stereo, 10 audio latents (0.25 s at 40/s)
L=5
xv=torch.randn(B,C,F,H,W); xa=torch.randn(B,S,AUDIO_C,T); txt=torch.randn(B,L,TEXT_DIM)
kw=pack_inputs(xv,xa,txt,t_video=0.3,t_audio=0.6)
for k,v in kw.items(): print(k, tuple(v.shape), v.dtype)
print("timestep", kw["timestep"], "unique idx per modality:", kw["timestep_indices"][kw["text_indices"]].unique().tolist(), kw["timestep_indices"][kw["audio_indices"]].unique().tolist(), kw["timestep_indices"][kw["video_indices"]].unique().tolist())
print("pos text", kw["position_ids"][:3].tolist()); print("pos audio ch0/ch1", kw["position_ids"][L].tolist(), kw["position_ids"][L+T].tolist(), kw["position_ids"][L+T-1].tolist())
print("pos video f0,f1,f2", kw["position_ids"][L+S*T].tolist(), kw["position_ids"][L+S*T+16].tolist(), kw["position_ids"][L+S*T+32].tolist())
# 1. pack/unpack round trip (identity)
vv,aa=unpack_output((kw["hidden_states"],kw["audio_hidden_states"]), xv.shape, xa.shape)
print("roundtrip exact:", torch.equal(vv,xv), torch.equal(aa,xa))
# 2. cross-check against the pipeline's own layout builder + patchify
from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep, patchify_video_latents, MiniMaxH3SetTimestepsStep
pos,tags,vi,ai,ti,_,_ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(torch.full((L,),1), F,H,W,T,(1,2,2),S,2,0)
print("layout == pipeline:", torch.equal(pos,kw["position_ids"]), torch.equal(tags,kw["token_tags"]), torch.equal(vi,kw["video_indices"]), torch.equal(ai,kw["audio_indices"]), torch.equal(ti,kw["text_indices"]))
print("patchify == pipeline:", torch.equal(patchify_video_latents(xv[:1],(1,2,2)), kw["hidden_states"][0]))
ts,tsi = MiniMaxH3SetTimestepsStep.build_row_timesteps(vi,ai,0,0,L,0.3,0.6,0.999,1.0)
print("row timesteps == pipeline:", torch.equal(ts,kw["timestep"]), torch.equal(tsi,kw["timestep_indices"]))
# pipeline audio packing: (S, C, T).permute(0,2,1).reshape(-1,C)
print("audio rows == pipeline:", torch.equal(xa[0].permute(0,2,1).reshape(-1,AUDIO_C), kw["audio_hidden_states"][0]))
# 3. forward
t0=time.time()
with torch.no_grad(): out=tr(**kw)
print("forward s", round(time.time()-t0,3), "sample", tuple(out.sample.shape), "audio_sample", tuple(out.audio_sample.shape))
vvel,avel=unpack_output(out, xv.shape, xa.shape); print("unpacked", tuple(vvel.shape), tuple(avel.shape))
# 4. batch is a pure replication axis: item b of batched == separate forward
with torch.no_grad():
    o1=tr(**pack_inputs(xv[1:],xa[1:],txt[1:],0.3,0.6))
print("batch item == single call:", torch.allclose(o1.sample, out.sample[1:], atol=1e-5), torch.allclose(o1.audio_sample,out.audio_sample[1:],atol=1e-5))
# 5. permutation equivariance: reorder the packed sequence -> identical outputs (positions are explicit, attention unmasked)
perm=torch.randperm(kw["position_ids"].shape[0]); inv=torch.argsort(perm)
kw2=dict(kw); 
kw2["position_ids"]=kw["position_ids"][perm]; kw2["token_tags"]=kw["token_tags"][perm]; kw2["timestep_indices"]=kw["timestep_indices"][perm]
for k in ["video_indices","audio_indices","text_indices"]: kw2[k]=inv[kw[k]]
with torch.no_grad(): out2=tr(**kw2)
print("sequence order irrelevant:", torch.allclose(out2.sample,out.sample,atol=1e-5), torch.allclose(out2.audio_sample,out.audio_sample,atol=1e-5))
# 6. sensitivity: t_audio only enters via audio rows' AdaLN (and attention); check outputs depend on both
with torch.no_grad():
    o3=tr(**pack_inputs(xv,xa,txt,0.3,0.9)); o4=tr(**pack_inputs(xv,xa,txt,0.3,0.3))
print("change t_audio changes audio out:", (o3.audio_sample-out.audio_sample).abs().max().item(), " and video out:", (o3.sample-out.sample).abs().max().item())
print("equal t -> num timesteps", pack_inputs(xv,xa,txt,0.3,0.3)["timestep"].numel())
# 7. return_dict=False
with torch.no_grad(): tup=tr(**kw, return_dict=False)
print("tuple len", len(tup))
# 8. text length variable -> no mask possible; show batch items must share L
print("forward params:", list(inspect.signature(tr.forward).parameters))
