import torch, time
from diffusers import MiniMaxH3Scheduler
from diffusers.models.embeddings import Timesteps
from tiny import *
torch.manual_seed(0)
# --- A. weight-free: wrapper conversion vs the native scheduler -------------------------------------------------
def to_h3_t(sigma): return 1.0 - sigma            # standard sigma (1=noise) -> H3 t (1=clean)
def to_std_velocity(v_h3): return -v_h3           # H3 data-ward v = x0 - eps  -> standard u = eps - x0
sch=MiniMaxH3Scheduler(shift=12.0); sch.set_timesteps(9)
print("sigmas", [round(s,4) for s in sch.sigmas.tolist()]); print("timesteps (H3 t)", [round(s,4) for s in sch.timesteps.tolist()])
x0=torch.randn(64); eps=torch.randn(64)
x=sch.scale_noise(x0, sch.timesteps[0], eps)       # = t*x0 + (1-t)*eps
x_std=x.clone(); maxerr=0
for i,t in enumerate(sch.timesteps):
    v_h3 = x0 - eps                                # oracle data-ward velocity (exact on the straight path)
    x = sch.step(v_h3, t, x).prev_sample
    s, s_next = sch.sigmas[i], sch.sigmas[i+1]
    x_std = x_std + (s_next - s) * to_std_velocity(v_h3)   # standard FlowMatch Euler in sigma
    maxerr=max(maxerr,(x-x_std).abs().max().item())
print("native H3 step == standard Euler with (t=1-sigma, u=-v):", maxerr, " lands on x0:", (x-x0).abs().max().item())
# flipped sign in the wrapper would diverge:
sch.set_timesteps(9); x=sch.scale_noise(x0, sch.timesteps[0], eps)
for t in sch.timesteps: x=sch.step(-(x0-eps), t, x).prev_sample
print("with flipped velocity sign, error to x0:", (x-x0).abs().max().item())
# --- B. timestep embedding scale: t in [0,1] unscaled -------------------------------------------------------------
tp=Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
e0,e1,e1000=tp(torch.tensor([0.0])),tp(torch.tensor([1.0])),tp(torch.tensor([1000.0]))
print("temb |e(1)-e(0)|:", (e1-e0).norm().item(), " |e(1000)-e(0)|:", (e1000-e0).norm().item())
