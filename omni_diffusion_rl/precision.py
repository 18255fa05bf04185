"""Mixed precision: the transformer's forward passes under autocast, everything else in fp32.

`train.mixed_precision=bf16` (or `accelerate launch --mixed_precision bf16`, which sets
ACCELERATE_MIXED_PRECISION for every process) runs generation and the training forward passes under
bf16 autocast; the trained weights, their gradients, the optimizer state and the losses stay fp32,
so no loss scaling is needed. fp16 is not offered (it would need a gradient scaler).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch

PRECISIONS = {"bf16": torch.bfloat16}
BASE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
"""model.base_dtype: how the frozen base weights are stored."""


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Tensors made without a dtype are `dtype` within (as diffusers and transformers build a model
    at its torch_dtype, buffers included); the previous default after."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def resolve_mixed_precision(configured: str) -> str:
    """The run's precision, fp32 or bf16: the config's, else what `accelerate launch
    --mixed_precision` set (ACCELERATE_MIXED_PRECISION: no or bf16)."""
    if configured != "fp32":
        return configured
    launched = os.environ.get("ACCELERATE_MIXED_PRECISION", "no").lower()
    if launched not in ("no", *PRECISIONS):
        raise ValueError(
            f"accelerate launch --mixed_precision {launched}: only bf16 is supported (fp16 would need "
            "a gradient scaler); use --mixed_precision bf16 or no"
        )
    return "fp32" if launched == "no" else launched


def autocast_factory(
    precision: str, device: torch.device
) -> Callable[[], contextlib.AbstractContextManager[object]]:
    """A zero-argument factory of the autocast context for `precision` on `device` (fp32: none)."""
    if precision == "fp32":
        return contextlib.nullcontext
    dtype = PRECISIONS[precision]
    return lambda: torch.autocast(device_type=device.type, dtype=dtype)


def base_weights_autocast(
    dtype: torch.dtype, device: torch.device
) -> contextlib.AbstractContextManager[object]:
    """Autocast to `dtype` for a model whose frozen weights are stored in it (model.base_dtype=bf16),
    so fp32 inputs and fp32 LoRA weights meet them in every path (training, sampling, odrl sample);
    nothing when the weights are fp32 or autocast is already on."""
    if dtype == torch.float32 or torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)
