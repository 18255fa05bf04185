"""Per-modality credit on the shared loop (algorithms/credit.py holds the math): the options a
credit-aware algorithm takes, the check made before the first step, and each modality's loss.

With algorithm.credit=per_modality, an update computes one advantage per modality (video, audio)
from the rewards that judge it, and takes its loss on each modality's entries of the latent with
that modality's advantage. The policy says where its modalities lie (`modality_entries`: the tiny
models' parts, LTX-2's and MiniMax-H3's video tokens then audio tokens); the rewards say what they
judge (their `modality`, or reward.modalities).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from ..algorithm_options import CreditOptions
from ..algorithms.credit import (
    MODALITIES,
    LossTerm,
    ModalityLoss,
    check_entries,
    modality_routes,
    per_modality_loss,
)
from ..config import ConfigError
from ..models.policy import modality_entries


def check_credit_rewards(
    section: object, modalities: Mapping[str, str | None], weights: Mapping[str, float]
) -> None:
    """Under algorithm.credit=per_modality, a ConfigError when a reward declares no modality or a
    modality has no reward: checked before the model loads."""
    if getattr(section, "credit", "global") != "per_modality":
        return
    try:
        modality_routes(modalities, MODALITIES, weights)
    except ValueError as e:
        raise ConfigError(f"algorithm.credit=per_modality: {e}") from e


def credit_entries(
    options: CreditOptions, policy: object, modalities: Mapping[str, str | None], weights: Mapping[str, float]
) -> dict[str, torch.Tensor] | None:
    """Each modality's entries of the policy's flat latent for per-modality credit (None: global);
    a ConfigError, before any step, when the policy or the rewards cannot give it."""
    if options.credit == "global":
        return None
    check_credit_rewards(options, modalities, weights)
    entries = modality_entries(policy)
    shape = tuple(getattr(policy, "latent_shape", ()))
    if entries is None or len(shape) != 1:
        raise ConfigError(
            f"algorithm.credit=per_modality: {type(policy).__name__}'s latent {shape} does not say where its "
            "video and its audio lie (modality_entries); per-modality credit needs an audio-video model "
            "(tiny_av, tiny_sync, ltx2, minimax_h3). Use algorithm.credit=global"
        )
    try:
        check_entries(entries, math.prod(shape))
    except ValueError as e:
        raise ConfigError(f"algorithm.credit=per_modality: {e}") from e
    return {m: entries[m] for m in MODALITIES}


def modality_terms(
    entries: Mapping[str, torch.Tensor],
    credit: torch.Tensor,
    balance: str,
    term: ModalityLoss,
) -> LossTerm:
    """The loss over modalities: `term(column, index, credit_m)` on each modality's entries with its
    column of `credit` [b, M] (the entries moved to its device), combined as `balance` says."""
    moved = {m: index.to(credit.device) for m, index in entries.items()}
    return per_modality_loss(moved, credit, term, balance)


def credit_metrics(credit: torch.Tensor, modalities: list[str], centre: float = 0.5) -> dict[str, float]:
    """Of the trained samples' credit [k, M] (r, centred at 0.5, or advantages, at 0): each
    modality's mean, and the share of samples whose modalities agree in sign (OmniNFT's advantage
    inconsistency is 1 minus it)."""
    out = {f"credit/{m}_mean": float(credit[:, i].mean()) for i, m in enumerate(modalities)}
    signs = torch.sign(credit - centre)
    out["credit/agreement"] = float((signs == signs[:, :1]).all(dim=1).float().mean())
    return out
