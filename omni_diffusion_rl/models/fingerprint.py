"""What a checkpoint's adapters were trained on: the model's identity in the config (family, base,
LoRA layout, the options that shape the latent) and its transformer's config, hashed.

Knobs that change memory or speed but not what the weights mean (gradient checkpointing, VAE
tiling and slicing, where the text encoder lives) are left out, so they can change between a run
and its resume. So are the transformer config's private entries (`_name_or_path`: where the base
was loaded from, which moves with the install; `_diffusers_version`). Checkpoints written before
these rules (their hash covers the whole model config, or the private entries) still match when
their recorded model config has the same identity and the private entries are this install's.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from torch import nn

RUNTIME_KNOBS = ("gradient_checkpointing",)
RUNTIME_OPTIONS = ("vae_tiling", "vae_slicing", "offload_text_encoder", "a2v_gradient_scales")
DEFAULT_DROPPED = {"base_dtype": "fp32"}
"""Keys added after checkpoints existed, left out at their default so those checkpoints match."""


def model_identity(model: dict[str, Any]) -> dict[str, Any]:
    """The model config (as a dict) without runtime knobs or keys at their back-compatible default."""
    identity = {k: v for k, v in model.items() if k not in RUNTIME_KNOBS}
    for key, default in DEFAULT_DROPPED.items():
        if identity.get(key) == default:
            identity.pop(key)
    options = identity.get("options")
    if isinstance(options, dict):
        identity["options"] = {k: v for k, v in options.items() if k not in RUNTIME_OPTIONS}
    return identity


def _hash(model: dict[str, Any], transformer: nn.Module, private: bool = True) -> str:
    """The digest of a model config and its transformer's config (`private`: with its entries that
    start with "_", as checkpoints before the rule hashed them)."""
    transformer_cfg = dict(transformer.config) if hasattr(transformer, "config") else {}
    if not private:
        transformer_cfg = {k: v for k, v in transformer_cfg.items() if not str(k).startswith("_")}
    payload = {"model": model, "transformer": transformer_cfg}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def model_fingerprint(model: dict[str, Any], transformer: nn.Module) -> str:
    """The fingerprint a checkpoint records for a model config dict and its built transformer."""
    return _hash(model_identity(model), transformer, private=False)


def fingerprint_matches(state: dict[str, Any], model: dict[str, Any], transformer: nn.Module) -> bool:
    """Whether a checkpoint's state (its `model_fingerprint` and recorded config) fits `model` and
    `transformer`: the current fingerprint, or an older checkpoint's whole-config hash when its
    recorded model has the same identity."""
    recorded = state.get("model_fingerprint")
    if not isinstance(recorded, str):  # a checkpoint's value: anything but a digest matches nothing
        return False
    if recorded in (model_fingerprint(model, transformer), _hash(model_identity(model), transformer)):
        return True
    config = state.get("config")
    saved = config.get("model") if isinstance(config, dict) else None
    if not isinstance(saved, dict) or model_identity(saved) != model_identity(model):
        return False
    return recorded == _hash(saved, transformer)
