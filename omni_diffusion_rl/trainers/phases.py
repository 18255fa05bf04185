"""What the training loop measured, handed to whoever plans around it (auto's re-check): the cost of
starting the loop and the phases of every step, as values rather than trainer attributes or metric
names."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class LoopStart:
    """A run's start, up to its first step."""

    building_started_at: float  # perf_counter when the trainer began building
    startup_s: float  # building, loading and the source's start, evaluation excluded: what a restart costs


@dataclass(frozen=True)
class StepPhases:
    """One step, timed by the loop (seconds)."""

    step: int  # steps done, this one included
    generate_s: float  # until this process's batch was there: generating it, or the wait for it
    reward_wait_s: float  # then until its scores were there
    train_s: float  # gathering, the update and the accounting
    rollout_group_s: float | None  # async: the rollout processes' mean seconds per group that arrived
    last_save_s: float  # the last checkpoint's seconds (0 before any)


@dataclass(frozen=True)
class ProcessPlace:
    """Where this trainer process stands: its rank among the trainer processes, their number, its
    device and the group over which the leader's decisions reach the others (None: all processes)."""

    rank: int
    world_size: int
    device: torch.device
    decision_group: Any = None
