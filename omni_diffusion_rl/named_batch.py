"""Experience as it crosses a process boundary: named tensors and texts, checked against a schema.

Whatever an algorithm's experience holds (a diffusion rollout's x0, condition and time grid; a
language model's tokens and behaviour log-probs), the replay buffer's transport carries it as a
`NamedBatch`: per-sample tensors (first dimension: the samples), per-sample texts, and tensors
shared by the whole batch. An experience type converts itself to and from one (`to_named` /
`from_named`) and names what it needs in a `BatchSchema`, which `check` enforces on what arrives.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class BatchSchemaError(ValueError):
    """A batch does not have the names or sizes its experience type needs."""


@dataclass
class NamedBatch:
    per_sample: dict[str, torch.Tensor] = field(default_factory=dict)
    texts: dict[str, list[str]] = field(default_factory=dict)
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def __len__(self) -> int:
        for tensor in self.per_sample.values():
            return int(tensor.shape[0]) if tensor.ndim else 0
        for values in self.texts.values():
            return len(values)
        return 0


@dataclass(frozen=True)
class BatchSchema:
    """What an experience type needs: per-sample tensor names (`prefixes`: any names starting with
    them, e.g. a condition's parts), per-sample text names and shared tensor names."""

    per_sample: tuple[str, ...] = ()
    prefixes: tuple[str, ...] = ()
    texts: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()

    def check(self, batch: NamedBatch, what: str = "batch") -> None:
        """BatchSchemaError naming what is missing, unexpected or of the wrong length."""
        for kind, needed, present in (
            ("per-sample tensor", self.per_sample, batch.per_sample),
            ("text", self.texts, batch.texts),
            ("shared tensor", self.shared, batch.shared),
        ):
            missing = [name for name in needed if name not in present]
            if missing:
                has = ", ".join(present) or "nothing"
                raise BatchSchemaError(f"{what} lacks the {kind} {', '.join(missing)} (it has {has})")
        allowed = set(self.per_sample)
        unexpected = [
            n for n in batch.per_sample if n not in allowed and not n.startswith(self.prefixes or ("\0",))
        ]
        unexpected += [n for n in batch.texts if n not in self.texts]
        unexpected += [n for n in batch.shared if n not in self.shared]
        if unexpected:
            names = ", ".join(unexpected)
            raise BatchSchemaError(f"{what} has names its experience type does not know: {names}")
        sizes = {name: int(t.shape[0]) if t.ndim else -1 for name, t in batch.per_sample.items()}
        sizes |= {name: len(values) for name, values in batch.texts.items()}
        if len(set(sizes.values())) > 1 or -1 in sizes.values():
            listed = ", ".join(
                f"{name} {size if size >= 0 else '(a scalar)'}" for name, size in sizes.items()
            )
            raise BatchSchemaError(
                f"{what}: its per-sample tensors and texts disagree on the samples: {listed}"
            )
        for name, values in batch.texts.items():
            if not all(isinstance(v, str) for v in values):
                raise BatchSchemaError(f"{what}: text {name} must be strings")
