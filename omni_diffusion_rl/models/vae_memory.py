"""Memory helpers shared by the diffusers video families: VAE decoding options (model.options
vae_tiling / vae_slicing: tiling decodes a large frame tile by tile, slicing a batch one clip at a
time), decoding into one output without full-size copies, and the dtype the base weights are stored
in."""

from __future__ import annotations

from collections.abc import Callable

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


def decode_into(
    decode: Callable[[torch.Tensor], torch.Tensor],
    latents: torch.Tensor,
    post_process: Callable[[torch.Tensor, torch.Tensor], None],
    vae: nn.Module,
) -> torch.Tensor:
    """Frames [B, F, 3, H, W] float32 from `decode` ([b, 3, F, H, W] pixels of latents [b, ...]):
    each sample's pixels go through `post_process(out, sample)`, which writes them into their place
    in the output, so no full-size float copy is made beside it. A VAE with slicing on is given one
    sample at a time (what its own slicing does), so only one sample's pixels exist at once."""
    parts = latents.split(1) if getattr(vae, "use_slicing", False) else [latents]
    frames: torch.Tensor | None = None
    row = 0
    for part in parts:
        pixels = decode(part)
        if frames is None:
            _, channels, count, height, width = pixels.shape
            shape = (len(latents), count, channels, height, width)
            frames = torch.empty(shape, dtype=torch.float32, device=pixels.device)
        for sample in pixels:
            post_process(frames[row], sample)
            row += 1
        del pixels
    assert frames is not None
    return frames
