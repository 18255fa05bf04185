"""The policy contract every generator adapter implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from ..media import MediaBatch

Condition = dict[str, torch.Tensor]
"""Encoded prompts: tensors whose first dimension is the batch."""


def repeat_condition(cond: Condition, repeats: int) -> Condition:
    """Each prompt's condition repeated `repeats` times in place (a, a, b, b, ...)."""
    return {k: v.repeat_interleave(repeats, dim=0) for k, v in cond.items()}


def index_condition(cond: Condition, index: torch.Tensor | slice) -> Condition:
    return {k: v[index] for k, v in cond.items()}


def cat_conditions(conds: list[Condition]) -> Condition:
    return {k: torch.cat([c[k] for c in conds]) for k in conds[0]}


def modality_entries(policy: object) -> dict[str, torch.Tensor] | None:
    """Where each modality lies in a policy's flat latent: {"video": index, "audio": index} (long
    tensors), from the policy's own `modality_entries()`; None for a policy of one modality or
    a latent it does not split (per-modality credit is then refused)."""
    method = getattr(policy, "modality_entries", None)
    return method() if callable(method) else None


def split_entries(sizes: dict[str, int]) -> dict[str, torch.Tensor]:
    """Index tensors of consecutive spans of the given sizes, in order: a latent of parts laid end
    to end."""
    out, start = {}, 0
    for name, size in sizes.items():
        out[name], start = torch.arange(start, start + size), start + size
    return out


@runtime_checkable
class FlowPolicy(Protocol):
    """A rectified-flow generator: x_t = (1 - t) x0 + t eps, velocity v = eps - x0.

    `transformer` is the trainable network (LoRA adapters are injected into it).
    """

    transformer: nn.Module

    @property
    def latent_shape(self) -> tuple[int, ...]:
        """Shape of one sample's latent (without the batch dimension)."""
        ...

    def encode_prompts(self, prompts: list[str]) -> Condition: ...

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        """Predicted velocity at (x_t, t); t has shape [B] with values in [0, 1]."""
        ...

    def decode(self, x0: torch.Tensor) -> MediaBatch: ...
