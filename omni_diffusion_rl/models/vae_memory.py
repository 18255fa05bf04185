"""Memory helpers shared by the diffusers video families: VAE decoding options (model.options
vae_tiling / vae_slicing: tiling decodes a large frame tile by tile, slicing a batch one clip at a
time) and the dtype the base weights are stored in."""

from __future__ import annotations

import torch
from torch import nn


def stored_dtype(model: nn.Module) -> torch.dtype:
    """bf16 when the model's weights are stored in bf16 (model.base_dtype; a few modules may be
    kept in fp32), else fp32."""
    return torch.bfloat16 if any(p.dtype == torch.bfloat16 for p in model.parameters()) else torch.float32


def configure_vae_memory(vae: nn.Module, tiling: bool | None, slicing: bool) -> None:
    """Turn tiling on or off (None keeps the VAE's own default) and slicing on when asked; a VAE
    that offers neither raises ValueError naming the option to drop."""
    if tiling is not None:
        method = getattr(vae, "enable_tiling" if tiling else "disable_tiling", None)
        if method is None:
            raise ValueError(f"{type(vae).__name__} has no tiled decoding; drop model.options.vae_tiling")
        method()
    if slicing:
        method = getattr(vae, "enable_slicing", None)
        if method is None:
            raise ValueError(f"{type(vae).__name__} has no sliced decoding; drop model.options.vae_slicing")
        method()
