"""OmniNFT's layer-wise gradient surgery for dual-stream audio-video transformers: in chosen blocks,
the gradient that flows back from the audio-to-video cross-attention (video queries reading audio
keys and values) into the audio stream is scaled by s; the forward pass is unchanged.

OmniNFT's released LTX-2 configuration (zghhui/OmniNFT, `config/nft.py`, `ca_kv_scale_a2v`) scales
it by 0 in block 0, 0.1 in blocks 1-10 and 0.3 in blocks 40-47 of LTX-2's 48, and leaves the others
(its audio-video "sync zone") at 1. The video loss then shapes the audio stream's shallow layers less.
The cross-attention's own weights (and their adapters) keep their full gradient: the scale acts on
the module's audio input, not on its parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

OMNINFT_LTX2_A2V_SCALES = {"0": 0.0, "1-10": 0.1, "40-47": 0.3}
"""OmniNFT's released block scales for LTX-2 (48 blocks)."""


def scaled_gradient(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x in the forward pass (exactly), with its gradient multiplied by `scale` in the backward."""
    frozen = x.detach()
    return frozen + scale * (x - frozen)


def block_scales(spec: Mapping[str, float], blocks: int) -> dict[int, float]:
    """{"0": 0.0, "1-10": 0.1} -> each named block's scale; a ValueError names a block outside
    0..blocks-1, a block named twice, or a scale outside [0, 1]."""
    out: dict[int, float] = {}
    for key, scale in spec.items():
        text = str(key).strip()
        first, _, last = text.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise ValueError(f"a2v_gradient_scales: {key!r} is not a block or a range of blocks like '1-10'")
        lo, hi = int(first), int(last or first)
        if not 0 <= lo <= hi < blocks:
            raise ValueError(f"a2v_gradient_scales: blocks {key!r} are outside this model's 0-{blocks - 1}")
        if isinstance(scale, bool) or not isinstance(scale, int | float) or not 0 <= scale <= 1:
            raise ValueError(
                f"a2v_gradient_scales: the scale of blocks {key!r} must be in [0, 1]; got {scale!r}"
            )
        for block in range(lo, hi + 1):
            if block in out:
                raise ValueError(f"a2v_gradient_scales: block {block} is named twice")
            out[block] = float(scale)
    return out


def scale_a2v_gradients(blocks: nn.ModuleList, scales: Mapping[int, float]) -> list[Any]:
    """Hook each named block's `audio_to_video_attn` so that its audio input (`encoder_hidden_states`)
    passes `scaled_gradient`; returns the hooks' handles (remove() undoes them)."""
    handles = []
    for index, scale in sorted(scales.items()):
        if scale == 1.0:
            continue

        def hook(_: nn.Module, args: tuple, kwargs: dict, scale: float = scale) -> tuple[tuple, dict]:
            audio = kwargs.get("encoder_hidden_states")
            if audio is not None and torch.is_grad_enabled():
                kwargs = {**kwargs, "encoder_hidden_states": scaled_gradient(audio, scale)}
            return args, kwargs

        module = blocks[index].audio_to_video_attn
        handles.append(module.register_forward_pre_hook(hook, with_kwargs=True))
    return handles
