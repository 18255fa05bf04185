"""Does the teacher's likelihood of a sample rank the base student's samples by correctness?

16 held-out prompts x 8 base samples; each forward-noised (one noise per group and time) to
t = 0.35, 0.6, 0.85 and the teacher's squared flow-matching error taken for every held-out prompt.
Scores: elbo (-error under its own prompt), margin (mean error under the other prompts minus its
own: a diffusion classifier's log-ratio) and logsm (a softmax over prompts). Printed: each score's
within-group AUC for all four right and each attribute. Usage: python THIS [base | CHECKPOINT].
(docs/algorithms.md, "Completion, contrast and the conditional direction".)"""
import sys, torch
torch.set_num_threads(1)
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.world.tiny_world import HELDOUT_PROMPTS
from omni_diffusion_rl.world import judge
from teachers.flow_policy import FlowPolicyTeacher

ckpt = sys.argv[1] if len(sys.argv) > 1 and sys.argv[1] != "base" else None
policy = load_policy(ckpt)
teacher = FlowPolicyTeacher()
prompts = list(HELDOUT_PROMPTS)
G = 8
noise = torch.randn((len(prompts) * G, *policy.latent_shape), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    ro = generate(policy, prompts, list(range(len(prompts))), noise, 10, 1.0, "euler")
    media = policy.decode(ro.x0)
d = judge.judge_clips(media.video, media.audio, media.sample_rate, ro.prompts)
x0 = ro.x0
N = len(x0)
times = [0.35, 0.6, 0.85]
gen = torch.Generator().manual_seed(1)
err = torch.zeros(N, len(prompts), len(times))
for ti, t in enumerate(times):
    eps = torch.randn((len(prompts), *x0.shape[1:]), generator=gen).repeat_interleave(G, 0)  # one per group
    xt = (1 - t) * x0 + t * eps
    target = eps - x0
    for p, cand in enumerate(prompts):
        v = teacher.velocity(xt, torch.full((N,), t), [cand] * N)
        err[:, p, ti] = ((v - target) ** 2).flatten(1).mean(1)
own = torch.arange(len(prompts)).repeat_interleave(G)
def auc(score, label, groups):
    # within-group pairwise AUC
    num = den = 0
    for g in groups.unique():
        m = groups == g
        s, l = score[m], label[m].bool()
        if l.all() or (~l).all(): continue
        pos, neg = s[l], s[~l]
        num += (pos[:, None] > neg[None]).float().sum() + 0.5 * (pos[:, None] == neg[None]).float().sum()
        den += len(pos) * len(neg)
    return float(num / max(den, 1)), den
for ti in list(range(len(times))) + ["all"]:
    e = err.mean(2) if ti == "all" else err[:, :, ti]
    own_err = e[torch.arange(N), own]
    other = (e.sum(1) - own_err) / (len(prompts) - 1)
    margin = other - own_err
    logsm = torch.log_softmax(-e / e.mean() * 20, 1)[torch.arange(N), own]
    for name, s in [("elbo", -own_err), ("margin", margin), ("logsm", logsm)]:
        print(ti, name, {k: auc(s, d[k], own) for k in ["all_correct", "shape", "color", "pitch", "timing"]})
print({k: float(d[k].float().mean()) for k in ["all_correct", "shape", "color", "pitch", "timing"]})
