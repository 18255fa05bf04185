"""Per-sample timesteps in ONE forward: concatenate samples along the sequence and isolate them with a
block-diagonal mask via a custom attention processor (the model's forward passes no mask itself)."""
import torch
from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AttnProcessor
from tiny import *
torch.manual_seed(0)
tr=tiny_transformer().eval()
class MaskedProc(MiniMaxH3AttnProcessor):
    masks={}   # seq_len -> bool mask (True = attend)
    def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
        return super().__call__(attn, hidden_states, rotary_emb, self.masks.get(hidden_states.shape[1]))
tr.set_attn_processor(MaskedProc())
C,F,H,W=VIDEO_C,3,4,4; S,T,L=2,4,3
items=[(torch.randn(1,C,F,H,W),torch.randn(1,S,AUDIO_C,T),torch.randn(1,L,TEXT_DIM),tv,ta) for tv,ta in [(0.2,0.5),(0.8,0.1)]]
with torch.no_grad():
    MaskedProc.masks={}
    singles=[tr(**pack_inputs(*it)) for it in items]
    kws=[pack_inputs(*it) for it in items]
    seqs=[k["position_ids"].shape[0] for k in kws]; offs=[0,seqs[0]]
    # text rows of all items first (encoder_hidden_states is concatenated along L), then media rows
    Ltot=sum(k["text_indices"].numel() for k in kws)
    g=[];lo=0;mo=0
    for k in kws:
        n=k["position_ids"].shape[0]; n_t=k["text_indices"].numel(); idx=torch.arange(n)
        g.append(torch.where(idx<n_t, lo+idx, Ltot+mo+idx-n_t)); lo+=n_t; mo+=n-n_t
    N=sum(seqs); owner=torch.empty(N,dtype=torch.long)
    pos=torch.empty(N,3,dtype=torch.float64); tags=torch.empty(N,dtype=torch.long); rt=torch.empty(N)
    for i,(k,gi) in enumerate(zip(kws,g)):
        owner[gi]=i; pos[gi]=k["position_ids"]; tags[gi]=k["token_tags"]; rt[gi]=k["timestep"][k["timestep_indices"]]
    ts,tsi=torch.unique(rt,sorted=True,return_inverse=True)
    textowner=torch.cat([torch.full((k["text_indices"].numel(),),i) for i,k in enumerate(kws)])
    MaskedProc.masks={N:(owner[:,None]==owner[None,:])[None,None], Ltot:(textowner[:,None]==textowner[None,:])[None,None]}
    out=tr(hidden_states=torch.cat([k["hidden_states"] for k in kws],1), audio_hidden_states=torch.cat([k["audio_hidden_states"] for k in kws],1),
           encoder_hidden_states=torch.cat([k["encoder_hidden_states"] for k in kws],1), timestep=ts, timestep_indices=tsi,
           token_tags=tags, position_ids=pos, video_indices=torch.cat([gi[k["video_indices"]] for k,gi in zip(kws,g)]),
           audio_indices=torch.cat([gi[k["audio_indices"]] for k,gi in zip(kws,g)]), text_indices=torch.cat([gi[k["text_indices"]] for k,gi in zip(kws,g)]))
    nv=[k["hidden_states"].shape[1] for k in kws]; na=[k["audio_hidden_states"].shape[1] for k in kws]
    print("timesteps in one call:", ts.tolist())
    print("video match:", [torch.allclose(a,b.sample,atol=1e-5) for a,b in zip(out.sample.split(nv,1),singles)],
          "audio match:", [torch.allclose(a,b.audio_sample,atol=1e-5) for a,b in zip(out.audio_sample.split(na,1),singles)])
