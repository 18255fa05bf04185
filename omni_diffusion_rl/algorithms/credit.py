"""Per-modality credit (algorithm.credit=per_modality): OmniNFT's modality-wise advantage routing as
pure functions.

Each reward declares the modality it judges: "video", "audio", or "audio_video" (synchrony: both).
A modality's advantage comes from the rewards that judge it (a synchrony reward feeds both, as in
OmniNFT's code), and the loss applies it to that modality's entries of the latent only: each
modality's loss is taken on its own entries with its own advantage, and the modalities' losses are
combined as their mean ("equal", OmniNFT's 50/50) or weighted by their shares of the entries
("entries", as one global advantage weighs them).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from ..algorithm_options import BALANCES as BALANCES
from ..algorithm_options import CREDITS as CREDITS

MODALITIES = ("video", "audio")
JUDGES = {"video": ("video",), "audio": ("audio",), "audio_video": ("video", "audio")}
"""What a reward may declare, and the modalities whose advantage it feeds."""


def modality_weights(entries: Mapping[str, torch.Tensor], balance: str) -> dict[str, float]:
    """How much each modality's loss weighs: equal, or its share of the latent's entries."""
    if balance == "equal":
        return {m: 1 / len(entries) for m in entries}
    if balance == "entries":
        return entry_shares(entries)
    raise ValueError(f"unknown credit balance {balance!r}; choose one of {', '.join(BALANCES)}")


def modality_routes(
    declared: Mapping[str, str | None],
    modalities: tuple[str, ...],
    weights: Mapping[str, float] | None = None,
) -> dict[str, list[str]]:
    """The rewards feeding each of `modalities`' advantage, from each reward's declared modality
    (rewards of weight 0 in `weights` feed none); a ValueError names a reward that declares none
    (or an unknown one) and a modality no reward judges."""
    if weights is not None:
        declared = {name: judged for name, judged in declared.items() if weights.get(name, 0) > 0}
    undeclared = sorted(name for name, judged in declared.items() if judged not in JUDGES)
    if undeclared:
        told = ", ".join(f"{name} ({declared[name]!r})" for name in undeclared)
        raise ValueError(
            f"per-modality credit needs every reward's modality; {told} declare none of "
            f"{', '.join(JUDGES)}: set the reward class's `modality` attribute, or "
            "reward.modalities.<name> in the config"
        )
    routes = {m: sorted(n for n, judged in declared.items() if m in JUDGES[str(judged)]) for m in modalities}
    empty = [m for m, names in routes.items() if not names]
    if empty:
        raise ValueError(
            f"per-modality credit: no reward judges the {' or '.join(empty)} of the clip (rewards: "
            f"{', '.join(f'{n}: {j}' for n, j in sorted(declared.items()))}); add one, or use credit: global"
        )
    return routes


def entry_shares(entries: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Each modality's share of the latent's entries (index tensors over the flat latent)."""
    total = sum(len(index) for index in entries.values())
    return {m: len(index) / total for m, index in entries.items()}


def check_entries(entries: Mapping[str, torch.Tensor], size: int) -> None:
    """A ValueError unless the modalities' entries split the flat latent of `size` entries exactly."""
    seen = torch.cat([index.flatten() for index in entries.values()]) if entries else torch.zeros(0)
    if len(seen) != size or not torch.equal(torch.sort(seen).values, torch.arange(size)):
        raise ValueError(
            f"the modalities' entries ({', '.join(f'{m}: {len(i)}' for m, i in entries.items())}) must "
            f"cover the latent's {size} entries once each"
        )


LossTerm = tuple[torch.Tensor, dict[str, torch.Tensor]]
ModalityLoss = Callable[[int, torch.Tensor, torch.Tensor], LossTerm]
"""(column, index, advantage [b]) -> one modality's loss and metrics: the modality's column in the
advantages and in anything recorded per modality, its entries of the flat latent, its advantage."""


def per_modality_loss(
    entries: Mapping[str, torch.Tensor],
    advantages: torch.Tensor,
    modality_loss: ModalityLoss,
    balance: str = "equal",
) -> LossTerm:
    """sum_m w_m L(m, entries_m, A[:, m]) with w from `modality_weights`; advantages [b, M] holds
    the modalities in the order of `entries`. Metrics are weighted alike."""
    if advantages.ndim != 2 or advantages.shape[1] != len(entries):
        raise ValueError(
            f"advantages {tuple(advantages.shape)} must be [b, {len(entries)}] for modalities {list(entries)}"
        )
    shares = modality_weights(entries, balance)
    total: torch.Tensor | None = None
    metrics: dict[str, torch.Tensor] = {}
    for column, (modality, index) in enumerate(entries.items()):
        loss, own = modality_loss(column, index, advantages[:, column])
        total = shares[modality] * loss if total is None else total + shares[modality] * loss
        for name, value in own.items():
            metrics[name] = metrics.get(name, 0.0) + shares[modality] * value
    assert total is not None
    return total, metrics
