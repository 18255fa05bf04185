"""Kept for plug-ins written against it, for one release: the shared update moved to skeleton.py and
each built-in algorithm to its own module (nft.py, distill.py, raft.py). Import from those."""

from __future__ import annotations

from .distill import OnPolicyDistillation, completed_order, contrast_pairs, teacher_rows
from .nft import DiffusionNFT
from .raft import RewardRankedFineTuning, best_of_each_group
from .skeleton import (
    Algorithm,
    MicroBatch,
    NoisedRows,
    Plan,
    TrainedRows,
    UpdateBatch,
    Work,
    algorithm_class,
    build_algorithm,
    finite_if_dropped,
    micro_batches,
    noised_inputs,
    split_at,
    trained_rows,
)

__all__ = [
    "Algorithm",
    "DiffusionNFT",
    "MicroBatch",
    "NoisedRows",
    "OnPolicyDistillation",
    "Plan",
    "RewardRankedFineTuning",
    "TrainedRows",
    "UpdateBatch",
    "Work",
    "algorithm_class",
    "best_of_each_group",
    "build_algorithm",
    "completed_order",
    "contrast_pairs",
    "finite_if_dropped",
    "micro_batches",
    "noised_inputs",
    "split_at",
    "teacher_rows",
    "trained_rows",
]
