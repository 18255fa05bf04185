"""The trainer leader's accounting in the async modes: each step's groups settled in the buffer
(trained, or dropped by reason), where the trainer's and the rollout processes' time went, the
step's buffer, staleness, idle and lending metrics, and the run summary."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

from ..buffer import Group, ReplayBuffer
from ..config import ExperimentConfig
from ..experience.rollout import Rollout
from ..reward import ScoreResult
from .lending import Lender
from .receiving import GroupReceiver
from .stream import StreamPosition


class LeaderAccounts:
    """What the trainer leader measures and settles (the buffer keeps the sample counts)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        buffer: ReplayBuffer[tuple[Rollout, ScoreResult]],
        ready: threading.Condition,
        stream: StreamPosition,
        receiver: GroupReceiver,
        lender: Lender,
    ) -> None:
        self.cfg, self.buffer, self.ready, self.stream = cfg, buffer, ready, stream
        self.receiver, self.lender = receiver, lender
        self.lend = cfg.execution.mode == "hybrid"
        self.loop_start: float | None = None  # the first step's start (start-up and evaluation excluded)
        self.last_step_end = time.perf_counter()
        self.waiting_s = self.sync_s = 0.0  # the trainer's idle seconds: waiting for data, syncing
        self.depths: list[int] = []  # the buffer's depth when each step's groups were taken
        self.rollout_idle_at_start: dict[str, float] | None = None
        self.trained_before = 0  # a resumed run reports its own share (the checkpoint restores totals)
        self.rollout_group_s: float | None = None  # rollout's mean seconds per group during the last step

    @property
    def idle(self) -> dict[str, float]:
        """The trainer leader's idle seconds by reason."""
        return {
            "waiting_for_data": self.waiting_s,
            "weight_sync": self.sync_s,
            "switching": self.lender.switch_s,
        }

    def waiting_started(self, start: float) -> None:
        """The first wait for a step's groups starts the loop's clock and rollout's idle baseline."""
        if self.loop_start is None:
            self.loop_start = start
        if self.rollout_idle_at_start is None:
            self.rollout_idle_at_start = self.receiver.idle()

    def settle(
        self,
        batch: list[Group[tuple[Rollout, ScoreResult]]],
        version: int,
        step_ok: torch.Tensor,
        step_keep: torch.Tensor,
    ) -> None:
        """Each of the step's groups: its trained samples, and those the trainer dropped, by reason."""
        with self.ready:
            start = 0
            for group in batch:
                rows = slice(start, start + group.size)
                start = rows.stop
                ok, keep = step_ok[rows], step_keep[rows]
                dropped = {"reward_failed": int((~ok).sum()), "group_too_small": int((ok & ~keep).sum())}
                self.buffer.settle(group, version, int(keep.sum()), dropped)
                self.stream.trained(group.group_id)

    def step_metrics(self) -> dict[str, float]:
        """The buffer, staleness, idle (trainer and rollout) and lending metrics of the last step."""
        self.last_step_end = time.perf_counter()
        lags = self.buffer.stats.staleness
        group_seconds = self.receiver.take_group_seconds()
        metrics: dict[str, float] = {}
        self.rollout_group_s = sum(group_seconds) / len(group_seconds) if group_seconds else None
        if self.rollout_group_s is not None:
            metrics["rollout/seconds_per_group"] = self.rollout_group_s
        rollout_idle = self.receiver.idle()
        metrics.update(
            {
                "buffer/depth": float(self.depths[-1]),
                "staleness/max": float(max(lags) if lags else 0),
                "samples/dropped/stale": float(self.buffer.stats.dropped.get("stale", 0)),
                **{f"idle/trainer_{k}_s": v for k, v in self.idle.items()},
                **{f"idle/rollout_{k}_s": v for k, v in rollout_idle.items() if k != "generating"},
                **{f"rollout/{k}": v for k, v in self.receiver.experience_totals().items()},
            }
        )
        if self.lend:
            metrics["hybrid/lent_groups"] = float(self.stream.lent_made)
            metrics["hybrid/lending_s"] = self.lender.lending_s
        return metrics

    def summary(self, buffer_stats: dict[str, Any], trainers: int) -> dict[str, Any]:
        """The run's execution summary: speed, the buffer's accounting, idle fractions, lending."""
        loop_s = self.last_step_end - (self.loop_start or self.last_step_end)
        trained_prompts = (self.buffer.stats.trained - self.trained_before) / self.cfg.data.group_size
        rollout_s = loop_s * len(self.receiver.rollout_ranks)
        at_start = self.rollout_idle_at_start or {}
        rollout_idle = {k: v - at_start.get(k, 0.0) for k, v in self.receiver.idle().items()}
        idle = self.idle
        out = {
            "mode": self.cfg.execution.mode,
            "trainer_replicas": trainers,
            "rollout_replicas": len(self.receiver.rollout_ranks),
            "seconds_per_trained_prompt": round(loop_s / max(1, trained_prompts), 4),
            "buffer": buffer_stats,
            "idle_s": {k: round(v, 3) for k, v in idle.items()},
            "idle_fraction": {
                "trainer": {k: round(v / loop_s, 4) for k, v in idle.items()} if loop_s else {},
                "rollout": {k: round(v / rollout_s, 4) for k, v in rollout_idle.items() if k != "generating"}
                if rollout_s
                else {},
            },
            "rollout_generating_fraction": round(rollout_idle["generating"] / rollout_s, 4)
            if rollout_s
            else 0.0,
            "rollout_seconds_since_loop_start": {k: round(v, 3) for k, v in rollout_idle.items()},
            "max_buffer_depth": max(self.depths, default=0),
        }
        if self.lend:
            out["hybrid"] = self.lender.summary()
        return out
