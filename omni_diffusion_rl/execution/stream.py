"""The trainer leader's view of the data stream in the async modes: where rollout starts, how far it
has sent groups, what will never be trained, and the groups lent from outside the stream."""

from __future__ import annotations

from dataclasses import dataclass

from . import scheduler


@dataclass
class StreamPosition:
    """Counters of the data stream (scheduler.may_make_group reads them through `offset`)."""

    start: int = 0  # the first stream position rollout makes (after a resume: past all received)
    next: int = 0  # one past the newest stream group received
    skipped: int = 0  # stream groups that will never be trained (stale, lost on a resume)
    lent_made: int = 0  # hybrid: groups the trainers made themselves (their ids: LENT_STREAM_START + n)
    lent_trained: int = 0  # of those, trained
    offset_changed: bool = False  # rollout must hear the new offset (else a gated process could wait)

    def offset(self) -> int:
        """The net stream positions the trainer never trains (skipped minus lent groups trained)."""
        return scheduler.stream_offset(self.skipped, self.lent_trained)

    def received(self, group_id: int) -> None:
        """A stream group arrived."""
        self.next = max(self.next, group_id + 1)

    def trained(self, group_id: int) -> None:
        """A group of the step was settled: lent ones count toward the offset."""
        self.lent_trained += group_id >= scheduler.LENT_STREAM_START

    def resume(self, step: int, prompts_per_step: int, saved: dict | None) -> None:
        """Continue past everything received (`saved`: a checkpoint's counters; None: a colocated
        checkpoint, which continues at step * prompts_per_step)."""
        if saved is None:
            self.start = step * prompts_per_step
        else:
            self.start = int(saved["stream_next"])
            self.lent_made, self.lent_trained = int(saved["lent_made"]), int(saved["lent_trained"])
        self.next = self.start
        self.skipped = self.start - (step * prompts_per_step - self.lent_trained)
