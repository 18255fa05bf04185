"""Where a trainer's batches come from: an `ExperienceSource`.

The trainer's loop asks its source for this process's share of each step (`next_batch`), learns
from it, and tells the source what became of every sample (`after_step`, which returns the source's
own step metrics). The source also starts and stops whatever feeds it (`start`, `finish`, `abort`),
keeps its state in checkpoints (`state_dict` / `load_state_dict`) and reports in the run summary.

`LocalSource` (colocated) generates the step's prompt groups on this process; the execution modes
add their own (execution/separate.py: the replay buffer fed by rollout processes, with lending, and
the share a trainer leader sends the other trainer processes). A source never looks inside the
algorithm: it sees experience, samples and their fate.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..reward import ScoreResult
from ..rollout import Rollout

if TYPE_CHECKING:
    from .trainer import Trainer


class ExperienceSource:
    """This process's scored experience for each step (see the module docstring)."""

    share_group: Any = None  # the process group over which a leader's decisions reach the others
    generated_at = 0.0  # perf_counter when the last batch finished generating (or arrived)
    rollout_group_s: float | None = None  # async: rollout's mean seconds per group during the last step

    def attach(self, trainer: Trainer) -> None:
        """Called once by the trainer it feeds (its experience maker, step and process group)."""
        self.trainer = trainer

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
    rollout weights (chunked and scored in the background with sampling.rollout_chunks > 1)."""

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        trainer = self.trainer
        prompts, group_ids = trainer.prompts_for_step(step)
        made = trainer.experience.make_step(step, prompts, group_ids)
        self.generated_at = trainer.experience.generated_at
        return made

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        return self.trainer.experience.metrics()
