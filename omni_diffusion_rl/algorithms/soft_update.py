"""Decay schedules for the soft update old <- d * old + (1 - d) * default."""

from __future__ import annotations

DECAY_SCHEDULES = ("copy", "linear_to_0_5", "delayed_linear_to_0_999")


def old_adapter_decay(schedule: str, step: int) -> float:
    """The decay d after optimizer step `step` (counted from 0)."""
    if schedule == "copy":
        return 0.0
    if schedule == "linear_to_0_5":
        return min(0.001 * step, 0.5)
    if schedule == "delayed_linear_to_0_999":
        return 0.0 if step < 75 else min(0.0075 * (step - 75), 0.999)
    raise ValueError(f"unknown decay schedule '{schedule}'; choose one of {', '.join(DECAY_SCHEDULES)}")
