"""Decay schedules for the soft update old <- d * old + (1 - d) * default."""

from __future__ import annotations

from ..algorithm_options import DECAY_SCHEDULES


def old_adapter_decay(schedule: str, updates: int) -> float:
    """The decay d of the soft update that follows optimizer update number `updates` (counted from 1,
    the updates made so far, as in the DiffusionNFT reference code)."""
    if schedule == "copy":
        return 0.0
    if schedule == "linear_to_0_5":
        return min(0.001 * updates, 0.5)
    if schedule == "delayed_linear_to_0_999":
        return 0.0 if updates < 75 else min(0.0075 * (updates - 75), 0.999)
    raise ValueError(f"unknown decay schedule '{schedule}'; choose one of {', '.join(DECAY_SCHEDULES)}")
