"""Probe for the toolkit's convention handling (not for checkpoint weights): train a tiny random-init model a
few hundred steps in the H3 convention on zero-mean bimodal data (x0 = +-a), then check weight-trained properties."""
import torch, time
import torch.nn.functional as Fn
from diffusers import MiniMaxH3Scheduler
from tiny import *
torch.manual_seed(0)
tr=tiny_transformer(num_layers=2)
B,C,F,H,W=16,VIDEO_C,2,4,4; S,T,L=2,4,3
a=torch.randn(1,C,F,H,W); b=torch.randn(1,S,AUDIO_C,T); txt=torch.randn(1,L,TEXT_DIM).expand(B,-1,-1)
def data():
    s=torch.randint(0,2,(B,1,1,1,1)).float()*2-1      # same sign for video+audio of one item (joint mode)
    return s*a+0.05*torch.randn(B,C,F,H,W), s[:,:,:,:,0]*b+0.05*torch.randn(B,S,AUDIO_C,T)
def vel(xv,xa,tv,ta): return unpack_output(tr(**pack_inputs(xv,xa,txt[:xv.shape[0]],tv,ta)),xv.shape,xa.shape)
opt=torch.optim.Adam(tr.parameters(),lr=2e-3); sched=torch.optim.lr_scheduler.CosineAnnealingLR(opt,800); t0=time.time()
for step in range(800):
    x0v,x0a=data(); ev,ea=torch.randn_like(x0v),torch.randn_like(x0a)
    tv,ta=torch.rand(()).item(),torch.rand(()).item()
    xv=tv*x0v+(1-tv)*ev; xa=ta*x0a+(1-ta)*ea              # H3 forward process (t=1 clean)
    pv,pa=vel(xv,xa,tv,ta)
    loss=Fn.mse_loss(pv,x0v-ev)+Fn.mse_loss(pa,x0a-ea)    # H3 target v = x0 - eps
    opt.zero_grad(); loss.backward(); opt.step(); sched.step()
print("train s", round(time.time()-t0,1), "final loss", round(loss.item(),3))
tr.eval()
cos=lambda u,v: Fn.cosine_similarity(u.flatten(1),v.flatten(1)).mean().item()
with torch.no_grad():
    ev,ea=torch.randn(B,C,F,H,W),torch.randn(B,S,AUDIO_C,T)
    pv,pa=vel(ev,ea,0.0,0.0); print("P1 t=0, x_t=noise: cos(v,x_t) video %.3f audio %.3f   (H3: -1; sign-flipped v: +1)"%(cos(pv,ev),cos(pa,ea)))
    x0v,x0a=data(); pv,pa=vel(x0v,x0a,1.0,1.0); print("P1 t=1, x_t=data : cos(v,x_t) video %.3f audio %.3f   (H3: +1)"%(cos(pv,x0v),cos(pa,x0a)))
    print("P2 x0-consistency: rel err of x0_hat = x_t + (1-t_true)*v(x_t, t_fed) vs x0, video")
    x0v,x0a=data(); ev,ea=torch.randn_like(x0v),torch.randn_like(x0a)
    for t in [0.5,0.7,0.9]:
        xv=t*x0v+(1-t)*ev; xa=t*x0a+(1-t)*ea
        r=[]
        for tf in [t,1-t]:
            pv,_=vel(xv,xa,tf,tf); r.append(((xv+(1-t)*pv-x0v).norm()/x0v.norm()).item())
        print(f"   t={t}: correct t {r[0]:.3f}   flipped t {r[1]:.3f}")
    def sample(flip_t=False, flip_v=False):
        sv,sa=MiniMaxH3Scheduler(shift=12.0),MiniMaxH3Scheduler(shift=3.0); sv.set_timesteps(30); sa.set_timesteps(30)
        xv,xa=torch.randn(B,C,F,H,W),torch.randn(B,S,AUDIO_C,T)
        for tv,ta in zip(sv.timesteps,sa.timesteps):
            fv,fa=(1-tv,1-ta) if flip_t else (tv,ta)
            pv,pa=vel(xv,xa,fv,fa)
            if flip_v: pv,pa=-pv,-pa
            xv=sv.step(pv,tv,xv).prev_sample; xa=sa.step(pa,ta,xa).prev_sample
        dv=torch.minimum(((xv-a)**2).mean((1,2,3,4)),((xv+a)**2).mean((1,2,3,4))).sqrt().mean()
        return dv.item()
    print("P3 native-scheduler sampling, rmse to nearest mode (data noise 0.05): correct %.3f  flipped-t %.3f  flipped-v %.3f"%(sample(),sample(flip_t=True),sample(flip_v=True)))
