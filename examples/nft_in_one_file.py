"""DiffusionNFT in one file: the demo's recipe, top to bottom, with nothing but torch, the tiny model
and the tiny world's rewards.

`odrl train recipes/configs/tiny_t2av_nft.yaml` (what `make demo` runs) on one process does exactly
this; tests/test_reference_nft.py runs both and asserts the same losses and the same adapters, bit
for bit. Read this file to see the algorithm whole (arXiv 2509.16117; docs/algorithms.md has the
options the framework adds: other execution modes, sharding, per-modality credit, ...).

One step:
1. sample 8 prompts, 8 samples each, with the `old` adapter (Euler ODE from seeded noise);
2. score them with the tiny world's rewards (a weighted mean);
3. group advantages -> an optimality probability r in [0, 1] per sample;
4. at 6 of the 10 grid times per sample, forward-noise x0 and take the NFT loss: the implicit
   positive and negative policies built from `old` and the trained adapter, weighed by r and
   1 - r, plus a KL term toward the base model; one AdamW step;
5. move `old` toward the trained adapter (soft update).

    python examples/nft_in_one_file.py --steps 240
"""

from __future__ import annotations

import argparse
import hashlib
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.world.tiny_world import TRAIN_PROMPTS
from rewards.tiny_world import (
    AVSyncReward,
    CleanBackgroundReward,
    ColorMatchReward,
    GroupDiversityReward,
    PitchMatchReward,
    ShapeMatchReward,
    TimingMatchReward,
)


@dataclass
class Recipe:
    """recipes/configs/tiny_t2av_nft.yaml with the defaults it leaves out (a test holds them equal)."""

    seed: int = 0
    steps: int = 240
    prompts_per_step: int = 8
    group_size: int = 8
    sampling_steps: int = 10
    time_shift: float = 1.0
    timestep_fraction: float = 0.6
    beta: float = 1.0
    adv_clip_max: float = 5.0
    kl_coef: float = 0.5
    lr: float = 2e-3
    weight_decay: float = 1e-4
    grad_clip: float = 1.0
    lora_rank: int = 16
    lora_alpha: float = 32.0
    lora_targets: tuple[str, ...] = ("to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out")
    reward_weights: dict[str, float] = field(
        default_factory=lambda: {
            "color_match": 1.0,
            "shape_match": 1.0,
            "pitch_match": 1.0,
            "timing_match": 1.0,
            "av_sync": 0.5,
            "clean_background": 0.5,
            "group_diversity": 0.5,
        }
    )


REWARDS = {
    "color_match": ColorMatchReward,
    "shape_match": ShapeMatchReward,
    "pitch_match": PitchMatchReward,
    "timing_match": TimingMatchReward,
    "av_sync": AVSyncReward,
    "clean_background": CleanBackgroundReward,
    "group_diversity": GroupDiversityReward,
}


# ---------------------------------------------------------------------------------------------
# Randomness: every draw comes from a generator keyed by (seed, step, prompt group, purpose)

PURPOSES = {"prompts": 1, "rollout": 2, "train": 3}


def keyed_generator(seed: int, step: int, index: int, purpose: str) -> torch.Generator:
    key = f"{seed}:{step}:{index}:{PURPOSES[purpose]}".encode()
    return torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(key).digest()[:8], "little") >> 1)


def prompt_at(seed: int, position: int) -> str:
    """The prompt stream: each epoch over the training prompts is a fresh permutation."""
    epoch, offset = divmod(position, len(TRAIN_PROMPTS))
    order = torch.randperm(len(TRAIN_PROMPTS), generator=keyed_generator(seed, epoch, 0, "prompts"))
    return TRAIN_PROMPTS[int(order[offset])]


# ---------------------------------------------------------------------------------------------
# Two LoRA adapters on the frozen base: `default` is trained, `old` samples the rollouts


class TwoAdapterLinear(nn.Module):
    """base(x) + B(A(x)) * alpha / rank with the active adapter's A and B, or base(x) alone."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base, self.scaling, self.rank = base, alpha / rank, rank
        self.adapters = nn.ModuleDict()
        self.active: str | None = "default"

    def add_adapter(self, name: str) -> None:
        a = nn.Linear(self.base.in_features, self.rank, bias=False)  # drawn as peft draws them
        b = nn.Linear(self.rank, self.base.out_features, bias=False)
        nn.init.kaiming_uniform_(a.weight, a=math.sqrt(5))
        nn.init.zeros_(b.weight)  # so the adapted model starts as the base
        self.adapters[name] = nn.ModuleDict({"A": a, "B": b})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        if self.active is None:
            return out
        adapter = self.adapters[self.active]
        return out + adapter["B"](adapter["A"](x)) * self.scaling


def add_adapters(model: nn.Module, recipe: Recipe) -> dict[str, TwoAdapterLinear]:
    """Wrap every target linear layer (by its path in the model); `old` starts as a copy of `default`."""
    model.requires_grad_(False)
    targets = [
        (name, m)
        for name, m in model.named_modules()
        if isinstance(m, nn.Linear) and name.rsplit(".", 1)[-1] in recipe.lora_targets
    ]
    layers = {}
    for name, linear in targets:
        parent, _, attribute = name.rpartition(".")
        layers[name] = TwoAdapterLinear(linear, recipe.lora_rank, recipe.lora_alpha)
        setattr(model.get_submodule(parent), attribute, layers[name])
    for adapter in ("default", "old"):
        for layer in layers.values():
            layer.add_adapter(adapter)
    soft_update(list(layers.values()), decay=0.0)
    return layers


def use(layers: list[TwoAdapterLinear], adapter: str | None) -> None:
    for layer in layers:
        layer.active = adapter


def trained_parameters(layers: list[TwoAdapterLinear]) -> list[nn.Parameter]:
    params = [layer.adapters["default"][part].weight for layer in layers for part in ("A", "B")]
    for p in params:
        p.requires_grad_(True)
    return params


@torch.no_grad()
def soft_update(layers: list[TwoAdapterLinear], decay: float) -> None:
    """old <- decay * old + (1 - decay) * default."""
    for layer in layers:
        for part in ("A", "B"):
            old, new = layer.adapters["old"][part].weight, layer.adapters["default"][part].weight
            old.mul_(decay).add_(new, alpha=1.0 - decay)


# ---------------------------------------------------------------------------------------------
# Sampling, rewards, advantages


def time_grid(recipe: Recipe) -> torch.Tensor:
    """sampling_steps + 1 times from 1 (noise) to 0 (data), shifted: t' = s t / (1 + (s - 1) t)."""
    t = torch.linspace(1.0, 0.0, recipe.sampling_steps + 1, dtype=torch.float64)
    s = recipe.time_shift
    return (s * t / (1 + (s - 1) * t)).float()


@torch.no_grad()
def sample(policy: TinyAVPolicy, cond: dict, noise: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Euler steps of dx/dt = v(x, t) from t = 1 to t = 0."""
    x = noise
    for t, t_next in zip(grid[:-1], grid[1:], strict=True):
        v = policy.transformer(x, t.expand(len(x)), cond["text_ids"], cond["text_mask"])
        x = x + (t_next - t) * v
    return x


def score(
    rewards: dict, weights: dict[str, float], policy: TinyAVPolicy, x0: torch.Tensor, prompts: list[str]
) -> torch.Tensor:
    """The weighted mean of the rewards of the decoded samples."""
    media, total_weight = policy.decode(x0), sum(weights.values())
    total = torch.zeros(len(prompts))
    for name, weight in weights.items():
        total += weight / total_weight * rewards[name].score(media, prompts).float()
    return total


def optimality(rewards: torch.Tensor, group_size: int, adv_clip_max: float) -> torch.Tensor:
    """A = (R - its group's mean) / (the batch's std + 1e-4), clipped; r = A / adv_clip_max / 2 + 0.5."""
    r = rewards.double()
    group_mean = r.view(-1, group_size).sum(1, keepdim=True) / group_size
    advantages = ((r.view(-1, group_size) - group_mean).flatten() / (r.std(correction=0) + 1e-4)).float()
    a = advantages.clamp(-adv_clip_max, adv_clip_max)
    return (a / adv_clip_max / 2 + 0.5).clamp(0, 1)


# ---------------------------------------------------------------------------------------------
# The NFT loss


def x0_loss(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample: mean ||x0_pred - x0||^2 / stop_gradient(mean |x0_pred - x0|)."""
    err = x0_pred - x0
    scale = err.detach().abs().double().flatten(1).mean(1).clamp(min=1e-5).to(err.dtype)
    return (err**2).flatten(1).mean(1) / scale


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    v_ref: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    r: torch.Tensor,
    recipe: Recipe,
) -> torch.Tensor:
    """adv_clip_max * mean[(r L+ + (1 - r) L-) / beta] + kl_coef * mean ||v_theta - v_ref||^2, with L+-
    the x0 losses of the implicit policies v+ = (1 - beta) v_old + beta v_theta, v- = (1 + beta)
    v_old - beta v_theta."""
    beta, t = recipe.beta, t.view(-1, 1)
    v_pos = (1 - beta) * v_old + beta * v_theta
    v_neg = (1 + beta) * v_old - beta * v_theta
    loss_pos, loss_neg = x0_loss(x_t - t * v_pos, x0), x0_loss(x_t - t * v_neg, x0)
    policy_loss = recipe.adv_clip_max * ((r * loss_pos + (1 - r) * loss_neg) / beta).mean()
    kl = ((v_theta - v_ref) ** 2).flatten(1).mean(1).mean()
    return policy_loss + recipe.kl_coef * kl


# ---------------------------------------------------------------------------------------------
# One step and the loop


def train_step(
    step: int,
    recipe: Recipe,
    policy: TinyAVPolicy,
    layers: list[TwoAdapterLinear],
    rewards: dict,
    optimizer: torch.optim.Optimizer,
    params: list[nn.Parameter],
) -> dict[str, float]:
    """One DiffusionNFT step (counted from 0): its loss, gradient norm, mean reward and decay."""
    k, seed, model = recipe.group_size, recipe.seed, policy.transformer
    groups = [step * recipe.prompts_per_step + i for i in range(recipe.prompts_per_step)]
    prompts = [prompt_at(seed, g) for g in groups]
    start = [
        torch.randn((k, model.layout.dim), generator=keyed_generator(seed, step, g, "rollout"))
        for g in groups
    ]
    ids, mask = policy.encode_prompts(prompts).values()
    cond = {"text_ids": ids.repeat_interleave(k, 0), "text_mask": mask.repeat_interleave(k, 0)}
    grid = time_grid(recipe)

    use(layers, "old")  # 1. the rollouts
    x0 = sample(policy, cond, torch.stack(start).flatten(0, 1), grid)
    use(layers, "default")
    with torch.no_grad():  # 2. their rewards
        total = score(rewards, recipe.reward_weights, policy, x0, [p for p in prompts for _ in range(k)])
    r = optimality(total, k, recipe.adv_clip_max)  # 3. the learning signal

    times = grid[:-1]  # 4. the trained times: a random share of the grid per sample, fresh noise
    trained = max(1, int(len(times) * recipe.timestep_fraction))
    orders, noises = [], []
    for g in groups:
        gen = keyed_generator(seed, step, g, "train")
        orders += [torch.randperm(len(times), generator=gen) for _ in range(k)]
        noises.append(torch.randn((trained, k, model.layout.dim), generator=gen))
    order, noise = torch.stack(orders), torch.cat(noises, dim=1)

    optimizer.zero_grad(set_to_none=True)
    loss_sum = 0.0
    for j in range(trained):
        t = times[order[:, j]]
        x_t = (1 - t[:, None]) * x0 + t[:, None] * noise[j]
        with torch.no_grad():
            use(layers, "old")
            v_old = model(x_t, t, cond["text_ids"], cond["text_mask"])
            use(layers, None)  # the base model, the KL's reference
            v_ref = model(x_t, t, cond["text_ids"], cond["text_mask"])
        use(layers, "default")
        v_theta = model(x_t, t, cond["text_ids"], cond["text_mask"])
        loss = nft_loss(v_theta, v_old, v_ref, x_t, x0, t, r, recipe)
        (loss / trained).backward()  # the gradient of the mean over the trained times
        loss_sum += float(loss.detach()) / trained
    grad_norm = torch.nn.utils.clip_grad_norm_(params, recipe.grad_clip)
    optimizer.step()
    decay = min(0.001 * (step + 1), 0.5)  # 5. old <- d old + (1 - d) default, d growing to 0.5
    soft_update(layers, decay)
    return {
        "loss/total": loss_sum,
        "grad_norm": float(grad_norm),
        "reward/mean": float(total.mean()),
        "old_decay": decay,
    }


def train(recipe: Recipe, log=print) -> tuple[list[dict[str, float]], dict[str, TwoAdapterLinear]]:
    """Every step's metrics, and the adapted layers (by their path in the model) after the last."""
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(recipe.seed)  # LoRA's A matrices are the only draws from the global generator
    rewards = {name: REWARDS[name]() for name in recipe.reward_weights}
    policy = TinyAVPolicy.from_pretrained("builtin")
    named_layers = add_adapters(policy.transformer, recipe)
    layers = list(named_layers.values())
    params = trained_parameters(layers)
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, weight_decay=recipe.weight_decay)
    history = []
    for step in range(recipe.steps):
        history.append(train_step(step, recipe, policy, layers, rewards, optimizer, params))
        log(f"step {step + 1}/{recipe.steps} " + " ".join(f"{k} {v:.4f}" for k, v in history[-1].items()))
    return history, named_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=Recipe.steps)
    parser.add_argument("--seed", type=int, default=Recipe.seed)
    args = parser.parse_args()
    train(Recipe(seed=args.seed, steps=args.steps))


if __name__ == "__main__":
    main()
