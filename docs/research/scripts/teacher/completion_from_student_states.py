"""What the teacher makes when it completes the student's own samples, and whether agreement with it
ranks them.

The base student samples the 16 held-out prompts x 8 (10 Euler steps, states recorded). From its
state at each grid time t the teacher (the shipped one, guided 3) runs Euler to the end: the
completion is judged by the tiny world's judge (all four right, shape). The agreement reward
-||x0_student - completion||^2 is scored by its within-group AUC for the student's own correctness
(all four, shape, colour): 0.5 means it does not rank. Usage: python THIS [base | CHECKPOINT].
(docs/algorithms.md, "Completion, contrast and the conditional direction".)"""
import sys, torch
torch.set_num_threads(2)
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.experience.rollout import generate, STATES
from omni_diffusion_rl.world.tiny_world import HELDOUT_PROMPTS
from omni_diffusion_rl.world import judge
from teachers.flow_policy import FlowPolicyTeacher
ckpt = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "base" else None
policy = load_policy(ckpt)
teacher = FlowPolicyTeacher()
prompts = list(HELDOUT_PROMPTS); G = 8
noise = torch.randn((len(prompts) * G, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ro = generate(policy, prompts, list(range(len(prompts))), noise, 10, 1.0, "euler", record_states=True)
    media = policy.decode(ro.x0)
d = judge.judge_clips(media.video, media.audio, media.sample_rate, ro.prompts)
own = torch.arange(len(prompts)).repeat_interleave(G)
def auc(score, label):
    num = den = 0
    for g in own.unique():
        m = own == g; s, l = score[m], label[m].bool()
        if l.all() or (~l).all(): continue
        pos, neg = s[l], s[~l]
        num += (pos[:, None] > neg[None]).float().sum() + 0.5 * (pos[:, None] == neg[None]).float().sum(); den += len(pos) * len(neg)
    return round(float(num / max(den, 1)), 3)
grid = ro.grid; states = ro.extras[STATES]
print("base", {k: round(float(d[k].float().mean()), 3) for k in ["all_correct", "shape"]})
for k in [1, 2, 3, 4, 5]:
    x = states[:, k].clone()
    for j in range(k, 10):
        x = x + (grid[j + 1] - grid[j]) * teacher.velocity(x, grid[j].expand(len(x)), ro.prompts)
    r = -((x - ro.x0) ** 2).flatten(1).mean(1)
    mt = policy.decode(x)
    dt = judge.judge_clips(mt.video, mt.audio, mt.sample_rate, ro.prompts)
    print(f"t={float(grid[k]):.1f}", "AUC all", auc(r, d["all_correct"]), "shape", auc(r, d["shape"]), "color", auc(r, d["color"]),
          "| completion's own: all", round(float(dt["all_correct"].float().mean()), 3), "shape", round(float(dt["shape"].float().mean()), 3))
