"""A versioned replay buffer: prompt groups tagged with the policy version that generated them.

Rollout puts whole prompt groups in; training takes the oldest groups out, each at most once.
A group whose version lags the trainer's by more than `max_staleness` is not trained: it is
dropped when taken (counted as stale). Under `execution.on_stale=wait` rollout is also held back
while what it would make would be trained too late (`execution.scheduler.may_make_group`), so that
few groups go stale (one that goes stale anyway is still dropped). The buffer is bounded (`capacity` groups);
`put` refuses to overfill it (except for a trainer's own lent group). Accounting always balances:

    generated = trained + dropped (by reason) + in the buffer + taken but not yet trained

Generic over the payload: the simulator stores nothing, the runtime stores rollouts.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class BufferFull(RuntimeError):
    """put() on a full buffer: rollout must wait (has_room says so first)."""


@dataclass
class Group(Generic[T]):
    """One prompt group: its samples, the policy version that made them, and when they arrived."""

    group_id: int
    version: int
    size: int  # samples in the group
    payload: T | None = None
    arrived: float = 0.0


@dataclass
class BufferStats:
    generated: int = 0  # samples put in
    trained: int = 0  # samples taken and marked trained
    dropped: Counter[str] = field(default_factory=Counter)  # samples dropped, by reason
    taken: int = 0  # samples taken out (trained or still being trained)
    staleness: Counter[int] = field(default_factory=Counter)  # samples trained, by version lag

    def as_dict(self) -> dict[str, Any]:
        return {
            "generated": self.generated,
            "trained": self.trained,
            "dropped": dict(self.dropped),
            "in_training": self.taken - self.trained,
            "staleness_histogram": {str(k): v for k, v in sorted(self.staleness.items())},
        }


class ReplayBuffer(Generic[T]):
    """Bounded FIFO of prompt groups with a staleness bound (see the module docstring)."""

    def __init__(self, capacity: int, max_staleness: int = 1) -> None:
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"capacity ({capacity}) must be >= 1 and max_staleness ({max_staleness}) >= 0")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.groups: deque[Group[T]] = deque()
        self.stats = BufferStats()
        self.last_stale: list[Group[T]] = []  # what the last take() or drop_stale() dropped

    # ------------------------------------------------------------------ state
    def __len__(self) -> int:
        """Prompt groups waiting to be trained."""
        return len(self.groups)

    @property
    def samples(self) -> int:
        return sum(g.size for g in self.groups)

    def is_stale(self, version: int, trainer_version: int) -> bool:
        return trainer_version - version > self.max_staleness

    def has_room(self, groups: int = 1, in_flight: int = 0) -> bool:
        """Whether `groups` more groups fit once the `in_flight` ones being generated have arrived."""
        return len(self.groups) + in_flight + groups <= self.capacity

    # ------------------------------------------------------------------ in and out
    def put(self, group: Group[T], overfill: bool = False) -> None:
        """Append a group; `overfill` lets the trainers' own lent groups in past the capacity (they
        train the buffer's groups next, so the excess is bounded by one lend's groups)."""
        if len(self.groups) >= self.capacity and not overfill:
            raise BufferFull(f"the buffer holds {self.capacity} groups already; rollout must wait")
        self.groups.append(group)
        self.stats.generated += group.size

    def drop_stale(self, trainer_version: int) -> list[Group[T]]:
        """Drop groups too old to train (counted as `stale`); returns them (also kept in `last_stale`)."""
        kept: deque[Group[T]] = deque()
        stale: list[Group[T]] = []
        for g in self.groups:
            (stale if self.is_stale(g.version, trainer_version) else kept).append(g)
        self.groups = kept
        if stale:
            self.stats.dropped["stale"] += sum(g.size for g in stale)
        self.last_stale = stale
        return stale

    def take(self, groups: int, trainer_version: int) -> list[Group[T]] | None:
        """The `groups` oldest trainable groups, or None (and nothing taken) when fewer are ready."""
        self.drop_stale(trainer_version)
        if len(self.groups) < groups:
            return None
        batch = [self.groups.popleft() for _ in range(groups)]
        self.stats.taken += sum(g.size for g in batch)
        return batch

    def mark_trained(self, batch: list[Group[T]], trainer_version: int) -> None:
        """Record that every sample of `batch` (from take) was trained at `trainer_version`."""
        for g in batch:
            self.settle(g, trainer_version, g.size, {})

    def settle(self, group: Group[T], trainer_version: int, trained: int, dropped: dict[str, int]) -> None:
        """Record a taken group: `trained` of its samples trained at `trainer_version`, the rest dropped
        by reason (e.g. a reward that failed on them)."""
        if trained + sum(dropped.values()) != group.size:
            raise ValueError(f"group {group.group_id}: {trained} trained + {dropped} dropped != {group.size}")
        self.stats.trained += trained
        self.stats.taken -= sum(dropped.values())
        self.stats.staleness[trainer_version - group.version] += trained
        for reason, n in dropped.items():
            if n:
                self.stats.dropped[reason] += n

    def discard(self, size: int, reason: str) -> None:
        """Samples that arrived but will not enter the buffer (e.g. after the run ended)."""
        self.stats.generated += size
        self.stats.dropped[reason] += size

    def drop_waiting(self, reason: str) -> int:
        """Drop every waiting group (e.g. at the end of a run); returns the samples dropped."""
        size = self.samples
        self.groups.clear()
        if size:
            self.stats.dropped[reason] += size
        return size

    def drop(self, batch: list[Group[T]], reason: str) -> None:
        """Samples taken but not trained (e.g. a failed reward), counted under `reason`."""
        for g in batch:
            self.stats.taken -= g.size
            self.stats.dropped[reason] += g.size

    def report(self) -> dict[str, Any]:
        """The counters in samples, with the samples waiting, after checking that they balance."""
        self.check_accounting()
        return self.stats.as_dict() | {"waiting": self.samples}

    def check_accounting(self) -> None:
        """Raise if generated != trained + dropped + buffered + in training."""
        s = self.stats
        accounted = s.trained + sum(s.dropped.values()) + self.samples + (s.taken - s.trained)
        if accounted != s.generated:
            raise AssertionError(f"buffer accounting off: generated {s.generated} != accounted {accounted}")

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Counters and the waiting groups' metadata (payloads are regenerated, not saved)."""
        return {
            "stats": self.stats.as_dict() | {"taken": self.stats.taken, "waiting": self.samples},
            "waiting": [(g.group_id, g.version, g.size) for g in self.groups],
        }

    def load_state_dict(self, state: dict[str, Any], dropped_on_resume: str = "resume") -> None:
        """Restore the counters; groups that were waiting are counted dropped (their payloads are gone)."""
        s = state["stats"]
        self.stats = BufferStats(
            generated=int(s["generated"]),
            trained=int(s["trained"]),
            dropped=Counter({k: int(v) for k, v in s["dropped"].items()}),
            taken=int(s["taken"]),
            staleness=Counter({int(k): int(v) for k, v in s["staleness_histogram"].items()}),
        )
        lost = sum(size for _, _, size in state["waiting"]) + (self.stats.taken - self.stats.trained)
        if lost:
            self.stats.dropped[dropped_on_resume] += lost
            self.stats.taken = self.stats.trained
        self.groups.clear()
