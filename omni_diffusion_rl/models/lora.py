"""Two named LoRA adapters on one network: `default` is trained, `old` samples rollouts.

The reference policy is the base network with every adapter disabled. peft is imported when adapters
are injected or looked for, not with this module: loading a config (an algorithm's options) imports
the trainers, and a launcher or `--check` would otherwise pay for peft and transformers (about 1.5 s).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..runtime.sharding import copy_whole_into, full_tensor

if TYPE_CHECKING:
    from peft.tuners.tuners_utils import BaseTunerLayer

TRAINED = "default"
OLD = "old"


def _lora_layers(model: nn.Module) -> list[BaseTunerLayer]:
    """The adapted layers, found once per model (adapter switches happen several times a step)."""
    cached = model.__dict__.get("_odrl_lora_layers")
    if cached is None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        cached = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
        if cached:
            model.__dict__["_odrl_lora_layers"] = cached
    return cached


class LoraTargetError(ValueError):
    """model.lora_targets names no module the model has (or one LoRA cannot adapt)."""


def _target_message(model: nn.Module, target_modules: list[str], reason: str) -> str:
    linear = sorted(
        {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    )
    return (
        f"model.lora_targets={target_modules}: {reason}. Name modules of this model, e.g. the linear "
        f"layers {linear[:12]} (empty: the family's default)"
    )


def add_nft_adapters(model: nn.Module, rank: int, alpha: float, target_modules: list[str]) -> None:
    """Inject the `default` and `old` adapters; `old` starts as an exact copy of `default`."""
    from peft import LoraConfig, inject_adapter_in_model

    for name in (TRAINED, OLD):
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=target_modules, init_lora_weights=True)
        with warnings.catch_warnings():  # peft warns that a second adapter is intended
            warnings.simplefilter("ignore", UserWarning)
            try:
                inject_adapter_in_model(config, model, adapter_name=name)
            except ValueError as e:  # peft: no target matched, or a module type it cannot adapt
                raise LoraTargetError(_target_message(model, target_modules, str(e).split(". ")[0])) from e
    if not _lora_layers(model):
        raise LoraTargetError(_target_message(model, target_modules, "nothing matched"))
    named = set(adapter_parameters(model, TRAINED)) | set(adapter_parameters(model, OLD))
    unnamed = sorted(k for k, _ in model.named_parameters() if "lora_" in k and k not in named)
    if unnamed:  # e.g. an embedding's LoRA (lora_embedding_A.<adapter>): it would never be trained
        layers = sorted({k.split(".lora_")[0].rsplit(".", 1)[-1] for k in unnamed})
        reason = f"LoRA on {layers} is not supported (its parameters are not weight matrices)"
        raise LoraTargetError(_target_message(model, target_modules, reason))
    for name, param in model.named_parameters():  # fp32 adapters on a bf16 base (peft copies its dtype)
        if "lora_" in name and param.dtype in (torch.bfloat16, torch.float16):
            param.data = param.data.float()
    copy_adapter(model, TRAINED, OLD)
    set_active_adapter(model, TRAINED)


def set_active_adapter(model: nn.Module, name: str) -> None:
    """Route forwards through adapter `name` (adapters enabled); only `default` ever requires grad."""
    for layer in _lora_layers(model):
        if layer.disable_adapters:
            layer.enable_adapters(True)
        # peft marks the active adapter trainable unless inference_mode; `old` is never trained.
        layer.set_adapter(name, inference_mode=name != TRAINED)


@contextmanager
def using_adapter(model: nn.Module, name: str) -> Iterator[None]:
    """Temporarily route forwards through adapter `name`, then back to `default`."""
    set_active_adapter(model, name)
    try:
        yield
    finally:
        set_active_adapter(model, TRAINED)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Temporarily run the base network (the reference policy)."""
    layers = _lora_layers(model)
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        set_active_adapter(model, TRAINED)


def adapter_parameters(model: nn.Module, name: str) -> dict[str, nn.Parameter]:
    """The LoRA parameters of adapter `name`, by their module path."""
    marker = f".{name}."
    return {k: p for k, p in model.named_parameters() if "lora_" in k and marker in k}


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Parameters of the trained adapter (everything else stays frozen)."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = adapter_parameters(model, TRAINED)
    for p in params.values():
        p.requires_grad_(True)
    return list(params.values())


def _paired(model: nn.Module, src: str, dst: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    src_params = adapter_parameters(model, src)
    dst_params = adapter_parameters(model, dst)
    return [(p, dst_params[key.replace(f".{src}.", f".{dst}.")]) for key, p in src_params.items()]


@torch.no_grad()
def copy_adapter(model: nn.Module, src: str, dst: str) -> None:
    for p_src, p_dst in _paired(model, src, dst):
        p_dst.copy_(p_src)


@torch.no_grad()
def soft_update_old(model: nn.Module, decay: float) -> None:
    """old <- decay * old + (1 - decay) * default."""
    if not 0.0 <= decay <= 1.0:
        raise ValueError(f"soft-update decay must lie in [0, 1]; got {decay}")
    for p_default, p_old in _paired(model, TRAINED, OLD):
        p_old.mul_(decay).add_(p_default, alpha=1.0 - decay)


def adapter_state_dict(model: nn.Module, name: str) -> dict[str, torch.Tensor]:
    """Adapter `name`'s whole tensors by module path. On a sharded model every process must call it
    (each tensor is gathered from its shards); an adapter with no parameters is an error, so a weight
    sync or a checkpoint can never carry nothing."""
    params = adapter_parameters(model, name)
    if not params:
        raise ValueError(
            f"adapter '{name}' has no parameters in this model ({type(model).__name__}): the LoRA layers "
            "bound nothing, so there is nothing to save or send"
        )
    return {k: full_tensor(p.detach()).clone().contiguous() for k, p in params.items()}


def nft_adapter_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Both adapters as one flat dict ('default/<param>', 'old/<param>') for a checkpoint."""
    return {f"{name}/{k}": v for name in (TRAINED, OLD) for k, v in adapter_state_dict(model, name).items()}


ADAPTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes adapter tensors may be loaded from (each cast to its parameter's dtype)."""


def load_nft_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Inverse of nft_adapter_tensors, for a checkpoint's tensors (untrusted): exactly the keys of
    both adapters, each a floating tensor of its parameter's shape whose values are finite in the
    parameter's dtype. Everything is checked before anything is copied."""
    by_adapter: dict[str, dict[str, torch.Tensor]] = {name: {} for name in (TRAINED, OLD)}
    for key, value in tensors.items():
        name, sep, param = key.partition("/")
        if not sep or name not in by_adapter:
            raise ValueError(
                f"unknown tensor {key[:120]!r}: a checkpoint holds only the '{TRAINED}/' and '{OLD}/' "
                "adapters' tensors"
            )
        by_adapter[name][param] = value
    params = {name: adapter_parameters(model, name) for name in by_adapter}
    for name, state in by_adapter.items():
        check_adapter_tensors(params[name], name, state)
    for name, state in by_adapter.items():
        _copy_adapter_tensors(params[name], state)


def check_adapter_tensors(params: dict[str, nn.Parameter], name: str, state: dict[str, torch.Tensor]) -> None:
    """A ValueError unless `state` holds exactly adapter `name`'s parameters, each a tensor of a
    floating dtype (ADAPTER_DTYPES) and the parameter's shape, finite once cast to its dtype."""
    _check_adapter_keys(params, name, state)
    for k, p in params.items():
        value = state[k]
        if not isinstance(value, torch.Tensor) or value.dtype not in ADAPTER_DTYPES:
            kind = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                f"adapter '{name}' tensor {k} is {kind}, not a floating tensor ({p.dtype}); an adapter "
                "is stored as float16, bfloat16, float32 or float64"
            )
        if p.shape != value.shape:
            raise ValueError(f"adapter '{name}' tensor {k}: shape {tuple(value.shape)} != {tuple(p.shape)}")
        if not bool(torch.isfinite(value.to(p.dtype)).all()):
            raise ValueError(
                f"adapter '{name}' tensor {k} holds NaN or infinite values (as {p.dtype}); the run that "
                "wrote it diverged, or the file was edited: use an earlier checkpoint"
            )


def _check_adapter_keys(params: dict[str, nn.Parameter], name: str, state: dict[str, torch.Tensor]) -> None:
    if not params or not state:
        where = "this model has no parameters of it" if not params else "the tensors given hold none of it"
        raise ValueError(f"adapter '{name}' binds no parameters: {where}; nothing would be loaded")
    missing = sorted(set(params) - set(state))
    unexpected = sorted(set(state) - set(params))
    if missing or unexpected:
        raise ValueError(
            f"adapter '{name}' does not match this model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )


@torch.no_grad()
def _copy_adapter_tensors(params: dict[str, nn.Parameter], state: dict[str, torch.Tensor]) -> None:
    for k, p in params.items():
        copy_whole_into(p, state[k])


@torch.no_grad()
def load_adapter_state_dict(model: nn.Module, name: str, state: dict[str, torch.Tensor]) -> None:
    """Adapter `name` <- `state` (a weight sync between this run's processes): the same keys and shapes."""
    params = adapter_parameters(model, name)
    _check_adapter_keys(params, name, state)
    for k, p in params.items():
        if p.shape != state[k].shape:
            raise ValueError(
                f"adapter '{name}' tensor {k}: shape {tuple(state[k].shape)} != {tuple(p.shape)}"
            )
    _copy_adapter_tensors(params, state)
