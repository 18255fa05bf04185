"""Load a trained policy from a checkpoint and generate media (used by `odrl sample`, `odrl eval`,
`odrl export` and notebooks).

Every command reads a checkpoint the same way: the verified files, the checked model section of its
config (`checkpoint.checkpoint_model`), the base built from it, the fingerprint compared and the
adapter tensors checked (`lora.load_nft_adapter_tensors`) before they are loaded.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (
    CheckpointError,
    checkpoint_model,
    checkpoint_sampling,
    load_checkpoint,
    resolve_checkpoint,
)
from .config import ConfigError, ModelConfig, SamplingConfig
from .experience.rollout import generate
from .media import MediaBatch, NonFiniteSamples
from .models import build_nft_policy, build_policy, lora
from .models.fingerprint import fingerprint_matches
from .models.policy import FlowPolicy

MAX_LATENT_ELEMENTS = 1 << 28
"""Latent elements of one sample a checkpoint's model may need (1 GiB in fp32): LTX-2 and MiniMax-H3
at their recipes' clip sizes need a few million; options that ask for more are refused."""


@dataclass(frozen=True)
class TrainedCheckpoint:
    """A verified checkpoint's adapter tensors, its state.json and the settings checked from it."""

    path: Path
    tensors: dict[str, torch.Tensor]
    state: dict[str, Any]
    model: ModelConfig
    sampling: SamplingConfig


def read_trained(checkpoint: str | Path) -> TrainedCheckpoint:
    """The checkpoint's adapters and checked model and sampling sections (no training state read,
    no model built)."""
    path = resolve_checkpoint(checkpoint)
    tensors, _, state = load_checkpoint(path, objects=False)
    return TrainedCheckpoint(
        path, tensors, state, checkpoint_model(state, path), checkpoint_sampling(state, path)
    )


def trained_policy(trained: TrainedCheckpoint, model: ModelConfig | None = None) -> Any:
    """The base `model` names (default: the checkpoint's) with the checkpoint's adapters loaded and
    the trained one active, after checking that it is the model they were trained on (latent size,
    fingerprint, adapter tensors). A base that cannot be built is a CheckpointError too."""
    model = model or trained.model
    try:
        policy = build_nft_policy(model)
    except (ConfigError, OSError) as e:
        raise CheckpointError(
            f"checkpoint {trained.path}: cannot build the base its adapters belong to (model.family="
            f"{model.family}, model.pretrained={model.pretrained}): {e}"
        ) from e
    _check_latent_size(policy, trained.path)
    if not fingerprint_matches(trained.state, dataclasses.asdict(model), policy.transformer):
        raise CheckpointError(
            f"checkpoint {trained.path} was trained on another base model than the one at "
            f"model.pretrained={model.pretrained} now (its transformer config differs); give the base "
            "it was trained on"
        )
    try:
        lora.load_nft_adapter_tensors(policy.transformer, trained.tensors)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {trained.path}: {e}") from e
    lora.set_active_adapter(policy.transformer, lora.TRAINED)
    policy.transformer.eval()
    return policy


def _check_latent_size(policy: Any, path: Path) -> None:
    shape = getattr(policy, "latent_shape", None)  # an answering policy has none
    if shape is not None and math.prod(shape) > MAX_LATENT_ELEMENTS:
        raise CheckpointError(
            f"checkpoint {path}: its model makes latents of shape {tuple(shape)}, over "
            f"{MAX_LATENT_ELEMENTS} elements a sample; its model.options ask for a clip larger than any "
            "this toolkit generates"
        )


def load_policy(checkpoint: str | Path | None = None, pretrained: str = "builtin") -> FlowPolicy:
    """The base policy, or the base plus a checkpoint's trained adapter (active) when given."""
    if checkpoint is None:
        policy, _ = build_policy(ModelConfig(pretrained=pretrained))
        return policy
    return trained_policy(read_trained(checkpoint))


@torch.no_grad()
def generate_media(
    policy: FlowPolicy,
    prompts: list[str],
    steps: int = 20,
    solver: str = "euler",
    seed: int = 0,
    shift: float = 1.0,
    cfg_scale: float = 1.0,
) -> MediaBatch:
    """One sample per prompt from seeded noise (cfg_scale: classifier-free guidance, 1 is off); a
    NonFiniteSamples error when a sample's latent is not finite (nothing is decoded or saved)."""
    noise = torch.randn((len(prompts), *policy.latent_shape), generator=torch.Generator().manual_seed(seed))
    rollout = generate(
        policy, prompts, list(range(len(prompts))), noise, steps, shift, solver, cfg_scale=cfg_scale
    )
    broken = int((~torch.isfinite(rollout.x0.reshape(len(prompts), -1)).all(dim=1)).sum())
    if broken:
        raise NonFiniteSamples(
            f"{broken} of {len(prompts)} samples came out with values that are not finite (NaN or infinity), "
            "so nothing was saved: the model's weights or adapters are far outside what training makes "
            "(a checkpoint edited or damaged?)"
        )
    return policy.decode(rollout.x0)
