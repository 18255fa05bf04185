"""Where a trainer's batches come from: an `ExperienceSource`.

The trainer's loop asks its source for this process's share of each step (`next_batch`), learns
from it, and tells the source what became of every sample (`after_step`, which returns the source's
own step metrics). The source also starts and stops whatever feeds it (`start`, `finish`, `abort`),
keeps its state in checkpoints (`state_dict` / `load_state_dict`) and reports in the run summary.

`LocalSource` (colocated) generates the step's prompt groups on this process; the execution modes
add their own (execution/separate.py: the replay buffer fed by rollout processes, with lending, and
the share a trainer leader sends the other trainer processes). A source never looks inside the
algorithm or the trainer: it is handed a `SourceContext` (the experience maker, the step clock and
the few facts and calls it needs) and sees experience, samples and their fate.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ExperimentConfig
from ..experience.rollout import ExperienceMaker, Rollout
from ..reward import ScoreResult


@dataclass(frozen=True)
class SourceContext:
    """What a source may use of the trainer it feeds, and nothing more."""

    cfg: ExperimentConfig
    experience: ExperienceMaker  # makes and scores prompt groups with the rollout weights
    device: torch.device  # where the trainer's batches go
    world_size: int  # the trainer processes that train together
    sharded: bool  # whether they shard the policy (a weight sync is then a collective)
    step_clock: Callable[[], int]  # the optimizer steps taken so far
    prompts_for_step: Callable[[int], tuple[list[str], list[int]]]  # this process's prompts, group ids
    rollout_state: Callable[[], dict[str, torch.Tensor]]  # what a weight sync sends to rollout

    @property
    def step(self) -> int:
        return self.step_clock()


class ExperienceSource:
    """This process's scored experience for each step (see the module docstring)."""

    share_group: Any = None  # the process group over which a leader's decisions reach the others
    generated_at = 0.0  # perf_counter when the last batch finished generating (or arrived)
    rollout_group_s: float | None = None  # async: rollout's mean seconds per group during the last step

    def attach(self, context: SourceContext) -> None:
        """Called once by the trainer it feeds."""
        self.context = context

    def start(self) -> None:
        """Before the first step (after a resume has loaded the state)."""

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        raise NotImplementedError

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        """The step is learned from: `ok`/`keep` say which of its samples (all processes) were
        scored and trained. Returns the source's step metrics."""
        return {}

    def finish(self) -> dict[str, Any]:
        """After the last step: stop what feeds the source; more for the run summary."""
        return {}

    def abort(self) -> None:
        """The run failed: stop what feeds the source without raising."""

    def state_dict(self) -> dict[str, Any]:
        """JSON state for checkpoints."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from the state of a whole checkpoint (which holds what state_dict saved)."""


class LocalSource(ExperienceSource):
    """Colocated: this process generates and scores its prompt groups of every step, with the
    rollout weights (chunked and scored in the background with sampling.rollout_chunks > 1).

    With teacher.one_step_off the next step's groups are made as soon as this step's are handed
    out, so that their teacher targets come while this step trains: each step then trains on
    rollouts one update old. Not before a step after which a checkpoint is saved (a resumed run
    makes that step's rollouts itself, as the uninterrupted run does: resume stays exact) nor past
    the last step (no sample is made that is not trained)."""

    ahead: tuple[int, tuple[Rollout, ScoreResult]] | None = None  # the next step's, made early
    staleness = 0  # updates between the rollout weights of the batch handed out and its training
    trained_pending: Any = None  # the teacher targets of the batch handed out (PendingExtras), if any

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        generated = False  # whether this call generated anything (its end is then the experience's)
        if self.ahead is not None:
            if self.ahead[0] != step:  # never dropped silently: its samples would go unaccounted
                raise RuntimeError(
                    f"step {step + 1} asked, but the rollouts made early are step {self.ahead[0] + 1}'s"
                )
            made, self.ahead, self.staleness = self.ahead[1], None, 1
        else:
            made, self.staleness, generated = self._make(step), 0, True
        if self._makes_ahead(step):
            self.ahead, generated = (step + 1, self._make(step + 1)), True
        self.generated_at = self.context.experience.generated_at if generated else time.perf_counter()
        self.trained_pending = made[0].pending
        return made

    def _make(self, step: int) -> tuple[Rollout, ScoreResult]:
        prompts, group_ids = self.context.prompts_for_step(step)
        return self.context.experience.make_step(step, prompts, group_ids)

    def _makes_ahead(self, step: int) -> bool:
        cfg = self.context.cfg
        every = cfg.train.checkpoint_every
        saves_after = bool(every) and (step + 1) % every == 0
        return cfg.teacher.one_step_off and step + 1 < cfg.train.steps and not saves_after

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        metrics = self.context.experience.metrics(self.trained_pending)
        if self.context.cfg.teacher.one_step_off:
            metrics["experience/staleness"] = float(self.staleness)
        return metrics
