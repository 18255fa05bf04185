"""Load a trained policy from a checkpoint and generate media (used by `odrl sample` and notebooks)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_checkpoint
from .config import ModelConfig
from .media import MediaBatch
from .models import build_nft_policy, build_policy, lora
from .models.fingerprint import fingerprint_matches
from .models.policy import FlowPolicy
from .rollout import generate


def load_policy(checkpoint: str | Path | None = None, pretrained: str = "builtin") -> FlowPolicy:
    """The base policy, or the base plus a checkpoint's trained adapter (active) when given."""
    if checkpoint is None:
        policy, _ = build_policy(ModelConfig(pretrained=pretrained))
        return policy
    tensors, _, state = load_checkpoint(checkpoint, objects=False)  # no training state read to sample
    model = checkpoint_model_config(state, checkpoint)
    policy = build_nft_policy(model)
    if not fingerprint_matches(state, dataclasses.asdict(model), policy.transformer):
        raise CheckpointError(
            f"checkpoint {checkpoint} was trained on another base model than the one at "
            f"model.pretrained={model.pretrained} now (its transformer config differs); give the base "
            "it was trained on"
        )
    try:
        lora.load_nft_adapter_tensors(policy.transformer, tensors)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {checkpoint}: {e}") from e
    lora.set_active_adapter(policy.transformer, lora.TRAINED)
    policy.transformer.eval()
    return policy


def checkpoint_model_config(state: dict, checkpoint: str | Path) -> ModelConfig:
    """The model configuration a checkpoint's state.json records, or a CheckpointError."""
    model = state.get("config", {}).get("model") if isinstance(state.get("config"), dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"checkpoint {checkpoint}: state.json records no model configuration")
    try:
        return ModelConfig(**model)
    except TypeError as e:
        raise CheckpointError(
            f"checkpoint {checkpoint}: state.json has a model configuration this version does not know ({e})"
        ) from e


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
