"""Pre-train the tiny base model on synthetic tiny-world clips (plain flow matching).

`odrl pretrain` writes the result to omni_diffusion_rl/assets/tiny_av_base, the model that
post-training starts from. Label noise makes it follow prompts only partly.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..algorithms.nft import flow_matching_loss
from ..models.tiny_av import BUILTIN_WEIGHTS, TinyAVPolicy, TinyAVTransformer
from . import tiny_world as world


def pretrain_base_model(
    output_dir: str | Path = BUILTIN_WEIGHTS,
    steps: int = 1500,
    batch_size: int = 64,
    dataset_size: int = 8192,
    label_noise: float = 0.5,
    lr: float = 1e-3,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Train from scratch and save with save_pretrained; returns summary numbers."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    prompts, latents = world.synthetic_batch(dataset_size, gen, label_noise=label_noise)
    policy = TinyAVPolicy(TinyAVTransformer())
    cond_all = policy.encode_prompts(prompts)
    opt = torch.optim.AdamW(policy.transformer.parameters(), lr=lr, weight_decay=1e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    start, loss_ema = time.time(), None
    bar = tqdm(range(steps), desc="pretrain tiny_av", disable=not progress)
    for _ in bar:
        idx = torch.randint(dataset_size, (batch_size,), generator=gen)
        x0 = latents[idx]
        noise = torch.randn(x0.shape, generator=gen)
        t = torch.sigmoid(torch.randn(batch_size, generator=gen))  # logit-normal times
        x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
        v = policy.velocity(x_t, t, {k: v[idx] for k, v in cond_all.items()})
        loss = flow_matching_loss(v, noise, x0)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(policy.transformer.parameters(), 1.0)
        opt.step()
        sched.step()
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.4f}")
    policy.transformer.save_pretrained(output_dir)
    return {"final_loss": float(loss_ema), "seconds": time.time() - start, "steps": steps}
