"""The versioned replay buffer: order, bounds, staleness, accounting, resume."""

from __future__ import annotations

import pytest

from omni_diffusion_rl.buffer import BufferFull, Group, ReplayBuffer


def _put(buffer: ReplayBuffer, version: int, count: int = 1, size: int = 4, start: int = 0) -> None:
    for i in range(count):
        buffer.put(Group(start + i, version, size))


def test_oldest_first_each_group_once_and_accounting_balances() -> None:
    buffer: ReplayBuffer[None] = ReplayBuffer(capacity=8, max_staleness=2)
    _put(buffer, version=0, count=3)
    _put(buffer, version=1, count=2, start=3)
    batch = buffer.take(2, trainer_version=1)
    assert [g.group_id for g in batch] == [0, 1]
    buffer.check_accounting()
    buffer.mark_trained(batch, trainer_version=1)
    again = buffer.take(3, trainer_version=2)
    assert [g.group_id for g in again] == [2, 3, 4], "never the same group twice, oldest first"
    buffer.drop(again[:1], reason="reward_failed")
    buffer.mark_trained(again[1:], trainer_version=2)
    buffer.check_accounting()
    stats = buffer.stats.as_dict()
    assert (stats["generated"], stats["trained"], stats["dropped"], stats["in_training"]) == (
        20,
        16,
        {"reward_failed": 4},
        0,
    )
    # groups 0, 1 (version 0) trained by version 1 and groups 3, 4 (version 1) by version 2: lag 1
    assert stats["staleness_histogram"] == {"1": 16}
    assert buffer.take(1, trainer_version=2) is None


def test_stale_groups_are_dropped_and_counted() -> None:
    buffer: ReplayBuffer[None] = ReplayBuffer(capacity=8, max_staleness=1)
    _put(buffer, version=0, count=2)
    _put(buffer, version=2, count=1, start=2)
    assert buffer.take(1, trainer_version=3) is not None
    assert buffer.stats.dropped["stale"] == 8
    buffer.check_accounting()


def test_room_counts_groups_in_flight() -> None:
    buffer: ReplayBuffer[None] = ReplayBuffer(capacity=2, max_staleness=1)
    assert buffer.has_room(2) and not buffer.has_room(3)
    _put(buffer, version=4, count=1)
    assert not buffer.has_room(1, in_flight=1), "room is counted with groups in flight"
    _put(buffer, version=4, count=1, start=1)
    assert not buffer.has_room()
    with pytest.raises(BufferFull):
        _put(buffer, version=4, count=1, start=2)


def test_resume_counts_lost_groups_as_dropped() -> None:
    buffer: ReplayBuffer[None] = ReplayBuffer(capacity=8)
    _put(buffer, version=0, count=4)
    batch = buffer.take(2, trainer_version=0)
    buffer.mark_trained(batch[:1], trainer_version=0)  # the crash hit while training batch[1]
    state = buffer.state_dict()
    restored: ReplayBuffer[None] = ReplayBuffer(capacity=8)
    restored.load_state_dict(state)
    restored.check_accounting()
    assert restored.stats.trained == 4 and restored.stats.dropped["resume"] == 12 and len(restored) == 0


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="max_staleness"):
        ReplayBuffer(4, max_staleness=-1)
    with pytest.raises(ValueError, match="capacity"):
        ReplayBuffer(0)
