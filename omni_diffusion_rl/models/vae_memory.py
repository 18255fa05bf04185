"""VAE decoding memory options shared by the diffusers video families (model.options vae_tiling /
vae_slicing): tiling decodes a large frame tile by tile, slicing decodes a batch one clip at a time."""

from __future__ import annotations

from torch import nn


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
