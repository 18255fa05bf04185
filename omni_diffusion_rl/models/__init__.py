"""Policy adapters: the built-in tiny audio-video model and diffusers transformers."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError

if TYPE_CHECKING:
    import torch

    from ..config import ModelConfig
    from .policy import FlowPolicy


class ModelLoadError(ConfigError):
    """model.pretrained cannot be loaded (missing folder, hub id not available offline, ...)."""


def _has_local(source: str, subfolder: str) -> bool:
    return (Path(source) / subfolder).is_dir()


def build_policy(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """The policy named by the config and its default LoRA target modules.

    For diffusers families, `pretrained` is a pipeline directory (or hub id) with a `transformer`
    subfolder; a `vae` subfolder decodes latents when present, and for sd3 a `text_encoder` (+
    `tokenizer`) subfolder encodes prompts (otherwise prompts are hashed offline).
    """
    try:
        return _build_policy(cfg)
    except (OSError, ValueError) as e:  # a missing folder, an offline or unknown hub id, a bad config.json
        if isinstance(e, ModelLoadError):
            raise
        raise ModelLoadError(
            f"model.pretrained={cfg.pretrained} (family {cfg.family}) could not be loaded: "
            f"{str(e).rstrip('.')}. Give a local directory written by save_pretrained, 'builtin' for the "
            "tiny model, or a hub id that is in the local cache (downloads are off when HF_HUB_OFFLINE=1)"
        ) from e


def _build_policy(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    if cfg.family == "tiny_av":
        from .tiny_av import DEFAULT_LORA_TARGETS, TinyAVPolicy

        return TinyAVPolicy.from_pretrained(cfg.pretrained), DEFAULT_LORA_TARGETS
    if cfg.family not in ("sd3", "stable_audio"):
        raise ValueError(f"unknown model family '{cfg.family}'; choose tiny_av, sd3 or stable_audio")
    from .diffusers_adapter import DiffusersAudioPolicy, DiffusersImagePolicy, TransformersPromptEncoder

    cls = DiffusersImagePolicy if cfg.family == "sd3" else DiffusersAudioPolicy
    is_local = Path(cfg.pretrained).exists()
    vae = "vae" if not is_local or _has_local(cfg.pretrained, "vae") else None
    policy = cls.from_pretrained(cfg.pretrained, vae_subfolder=vae)
    if cfg.family == "sd3" and is_local and _has_local(cfg.pretrained, "text_encoder"):
        config = policy.transformer.config
        policy.prompt_encoder = TransformersPromptEncoder.from_pretrained(
            cfg.pretrained, hidden_dim=config.joint_attention_dim, pooled_dim=config.pooled_projection_dim
        )
    return policy, list(policy.lora_target_modules)


def build_nft_policy(cfg: ModelConfig, device: torch.device | str = "cpu") -> FlowPolicy:
    """The policy on `device`, base frozen, with the `default` and `old` LoRA adapters added."""
    from . import lora

    policy, default_targets = build_policy(cfg)
    policy.transformer.to(device).requires_grad_(False)
    try:
        lora.add_nft_adapters(
            policy.transformer, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets or default_targets
        )
    except lora.LoraTargetError as e:
        raise ConfigError(str(e)) from e
    return policy
