"""Policy adapters: the built-in tiny audio-video model and diffusers transformers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from ..config import ConfigError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ..config import ModelConfig
    from .policy import FlowPolicy


class ModelLoadError(ConfigError):
    """model.pretrained cannot be loaded (missing folder, hub id not available offline, ...)."""


def build_policy(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """The policy of the config's model family (models/families.py, or a registered one) and its
    default LoRA target modules."""
    try:
        return _build_policy(cfg)
    except (OSError, ValueError) as e:  # a missing folder, an offline or unknown hub id, a bad config.json
        if isinstance(e, ConfigError):  # already says what is wrong (a ModelLoadError, a bad option)
            raise
        raise ModelLoadError(
            f"model.pretrained={cfg.pretrained} (family {cfg.family}) could not be loaded: "
            f"{str(e).rstrip('.')}. Give a local directory written by save_pretrained, 'builtin' for the "
            "tiny model, or a hub id that is in the local cache (downloads are off when HF_HUB_OFFLINE=1)"
        ) from e


def _build_policy(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    from ..registry import RegistryError
    from ..registry import models as model_families
    from . import families  # noqa: F401 - registers the built-in families

    try:
        loader = model_families.get(cfg.family)
    except RegistryError as e:
        raise ConfigError(f"model.family: {e}") from e
    return loader(cfg)


def build_nft_policy(
    cfg: ModelConfig, device: torch.device | str = "cpu", shard: Callable[[nn.Module], None] | None = None
) -> FlowPolicy:
    """The policy on `device`, base frozen, with the `default` and `old` LoRA adapters added. With
    `shard` (runtime/sharding.py), the transformer stays in host memory until `shard` places each process's
    part of it (a whole copy never goes to the device); the other components move to `device`. A
    family that can (models/shard_loading.py) then builds its transformer as a skeleton, and each
    process reads only its own part of the weights once sharding has placed it."""
    import torch

    from . import lora
    from .shard_loading import deferred_weights, has_deferred_weights, load_deferred_weights

    with contextlib.nullcontext() if shard is None else deferred_weights():
        policy, default_targets = build_policy(cfg)  # sharded: each process reads its part below
    if cfg.base_dtype != "fp32" and not any(
        p.dtype != torch.float32 for p in policy.transformer.parameters()
    ):
        raise ConfigError(
            f"model.base_dtype={cfg.base_dtype}: the {cfg.family} family loads its weights in fp32 only "
            "(ltx2 and minimax_h3 take bf16); set model.base_dtype=fp32"
        )
    move = getattr(policy, "to", None)
    if callable(move):  # every module it holds (VAEs, text encoder, ...), not only the transformer
        with contextlib.nullcontext() if shard is None else left_in_place(policy.transformer):
            move(device)
    if shard is None:
        policy.transformer.to(device)
    policy.transformer.requires_grad_(False)
    try:
        lora.add_nft_adapters(
            policy.transformer, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets or default_targets
        )
    except lora.LoraTargetError as e:
        raise ConfigError(str(e)) from e
    if cfg.gradient_checkpointing:
        enable = getattr(policy.transformer, "enable_gradient_checkpointing", None)
        try:
            if enable is None:
                raise ValueError("it has no enable_gradient_checkpointing()")
            enable()
        except ValueError as e:
            raise ConfigError(
                f"model.gradient_checkpointing=true: the {cfg.family} transformer "
                f"({type(policy.transformer).__name__}) cannot recompute its blocks ({e}); set it to false"
            ) from e
    if shard is not None:
        shard(policy.transformer)
        if has_deferred_weights(policy.transformer):
            load_deferred_weights(policy.transformer)
        told = getattr(policy, "use_sharded_transformer", None)
        if callable(told):  # a policy whose transformer calls depend on the data makes them fixed
            told()
    return policy


@contextlib.contextmanager
def left_in_place(module: nn.Module) -> Iterator[None]:
    """`module.to(...)` (called by a policy's own `to`, directly or through a pipeline) leaves the
    module where it is for the duration: sharding places it afterwards, a part per process."""
    module._apply = lambda fn, recurse=True: module  # type: ignore[method-assign]
    try:
        yield
    finally:
        del module._apply
