"""Does the teacher, used as a paired diffusion classifier, tell the base student's circles from
its squares?

16 held-out prompts x 8 base samples (10 Euler steps). Each sample is forward-noised with K
(t, noise) draws, t uniform in [T_LO, T_HI], the same draws for both prompts; the teacher's
unguided flow-matching error is taken under the sample's prompt and under the same prompt with
the shape word swapped. Score: mean error (swapped) - mean error (own). Printed: the score's AUC
for the judge's shape verdict (over all samples, and within groups), for K = 1, 4, 16, 32.
Usage: OMP_NUM_THREADS=1 python THIS
"""

import torch

from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.world import judge
from omni_diffusion_rl.world.tiny_world import HELDOUT_PROMPTS
from teachers.flow_policy import FlowPolicyTeacher

T_LO, T_HI, G = 0.2, 0.9, 8
torch.set_num_threads(1)
policy = load_policy(None)
teacher = FlowPolicyTeacher(cfg_scale=1.0)
prompts = list(HELDOUT_PROMPTS)
noise = torch.randn((len(prompts) * G, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ro = generate(policy, prompts, list(range(len(prompts))), noise, 10, 1.0, "euler")
    media = policy.decode(ro.x0)
verdict = judge.judge_clips(media.video, media.audio, media.sample_rate, ro.prompts)
shape_right = verdict["shape"].bool()
own = list(ro.prompts)
swapped = [p.replace("circle", "#").replace("square", "circle").replace("#", "square") for p in own]
x0, n = ro.x0, len(ro.x0)
gen = torch.Generator().manual_seed(1)
draws = []
for _ in range(32):
    t = T_LO + (T_HI - T_LO) * torch.rand(n, generator=gen)
    eps = torch.randn(x0.shape, generator=gen)
    x_t = (1 - t.view(-1, 1)) * x0 + t.view(-1, 1) * eps
    target = eps - x0
    errs = [((teacher.velocity(x_t, t, p) - target) ** 2).mean(1) for p in (own, swapped)]
    draws.append(errs[1] - errs[0])
draws = torch.stack(draws)  # [32, n]


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    pos, neg = score[label], score[~label]
    return float((pos[:, None] > neg[None]).float().mean()) if len(pos) and len(neg) else float("nan")


groups = torch.arange(len(prompts)).repeat_interleave(G)
print(f"base samples: shape right {float(shape_right.float().mean()):.3f}")
for k in (1, 4, 16, 32):
    score = draws[:k].mean(0)
    within = [auc(score[groups == g], shape_right[groups == g]) for g in range(len(prompts))]
    within = [a for a in within if a == a]
    print(f"K={k}: shape AUC {auc(score, shape_right):.3f}, within groups {sum(within) / len(within):.3f} "
          f"({len(within)} groups with both)")
