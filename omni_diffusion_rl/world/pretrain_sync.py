"""Pre-train the tiny sync base model on the tiny sync world's clips (plain flow matching).

`odrl pretrain --sync` writes the result to omni_diffusion_rl/assets/tiny_sync_base,
the model that post-training on the sync world starts from. Every step draws fresh clips of the
training split, their sound moved from their strikes and their counts off by one at times
(tiny_sync.BaseNoise), so the base draws the right objects and sounds but out of sync and
miscounting. The weights saved are an exponential moving average of the trained ones.
"""

from __future__ import annotations

import copy
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.tiny_sync import SYNC_BASE_WEIGHTS, TinySyncPolicy, TinySyncTransformer
from . import tiny_sync as world
from .pretrain import flow_matching_step, learning_rate


def pretrain_sync_model(
    output_dir: str | Path = SYNC_BASE_WEIGHTS,
    steps: int = 6000,
    batch_size: int = 64,
    noise: world.BaseNoise | None = None,
    lr: float = 1e-3,
    ema_decay: float = 0.998,
    seed: int = 0,
    progress: bool = True,
    fillers: int = 0,
    **model_config: object,
) -> dict[str, float]:
    """Train from scratch and save the moving average with save_pretrained; returns summary numbers.
    `fillers`: up to that many filler words in each training prompt (tiny_sync.with_fillers)."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    transformer = TinySyncTransformer(**model_config)  # type: ignore[arg-type]
    policy = TinySyncPolicy(transformer)
    average = copy.deepcopy(transformer).requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=1e-4)
    start, loss_ema = time.time(), None
    bar = tqdm(range(steps), desc="pretrain tiny_sync", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        prompts, x0 = world.training_batch(
            rng,
            batch_size,
            noise or world.BaseNoise(),
            fillers=fillers,
            window=transformer.config.max_text_tokens,
        )
        loss = flow_matching_step(policy, average, opt, prompts, x0, gen, ema_decay)
        loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
        bar.set_postfix(loss=f"{loss_ema:.4f}")
    average.save_pretrained(output_dir)
    return {"final_loss": float(loss_ema), "seconds": time.time() - start, "steps": steps}
