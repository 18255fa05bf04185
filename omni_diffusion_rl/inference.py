"""Load a trained policy from a checkpoint and generate media (used by `odrl sample` and notebooks)."""

from __future__ import annotations

from pathlib import Path

import torch

from .checkpoint import load_checkpoint
from .config import ModelConfig
from .media import MediaBatch
from .models import build_nft_policy, build_policy, lora
from .models.policy import FlowPolicy
from .rollout import generate


def load_policy(checkpoint: str | Path | None = None, pretrained: str = "builtin") -> FlowPolicy:
    """The base policy, or the base plus a checkpoint's trained adapter (active) when given."""
    if checkpoint is None:
        policy, _ = build_policy(ModelConfig(pretrained=pretrained))
        return policy
    tensors, _, state = load_checkpoint(checkpoint, objects=False)  # no pickle read to sample
    policy = build_nft_policy(ModelConfig(**state["config"]["model"]))
    lora.load_nft_adapter_tensors(policy.transformer, tensors)
    lora.set_active_adapter(policy.transformer, lora.TRAINED)
    policy.transformer.eval()
    return policy


@torch.no_grad()
def generate_media(
    policy: FlowPolicy,
    prompts: list[str],
    steps: int = 20,
    solver: str = "euler",
    seed: int = 0,
    shift: float = 1.0,
) -> MediaBatch:
    """One sample per prompt from seeded noise."""
    noise = torch.randn((len(prompts), *policy.latent_shape), generator=torch.Generator().manual_seed(seed))
    return policy.decode(generate(policy, prompts, list(range(len(prompts))), noise, steps, shift, solver).x0)
