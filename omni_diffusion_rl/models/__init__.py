"""Policy adapters: the built-in tiny audio-video model and diffusers transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .policy import FlowPolicy


def build_policy(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """The policy named by the config and its default LoRA target modules."""
    if cfg.family == "tiny_av":
        from .tiny_av import DEFAULT_LORA_TARGETS, TinyAVPolicy

        return TinyAVPolicy.from_pretrained(cfg.pretrained), DEFAULT_LORA_TARGETS
    if cfg.family == "sd3":
        from .diffusers_adapter import DiffusersImagePolicy

        policy = DiffusersImagePolicy.from_pretrained(cfg.pretrained)
        return policy, list(policy.lora_target_modules)
    if cfg.family == "stable_audio":
        from .diffusers_adapter import DiffusersAudioPolicy

        policy = DiffusersAudioPolicy.from_pretrained(cfg.pretrained)
        return policy, list(policy.lora_target_modules)
    raise ValueError(f"unknown model family '{cfg.family}'; choose tiny_av, sd3 or stable_audio")
