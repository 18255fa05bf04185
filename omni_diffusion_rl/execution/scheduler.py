"""Scheduling decisions as pure functions of state, shared by the simulator (virtual clock) and the
runtime (real clock): the sync schedule, the staleness gate on the data stream, and hybrid's
lending rule."""

from __future__ import annotations

from dataclasses import dataclass

from .planner.costs import CostModel, Workload

# Prompt groups a trainer generates itself (hybrid lending) come from this far part of the data
# stream, so their group ids (and noise keys) never meet the rollout processes' ids.
LENT_STREAM_START = 10**12


@dataclass(frozen=True)
class RolloutRate:
    """Measured or modelled speed of the rollout pool: groups per second."""

    groups_per_s: float


def rollout_rate(costs: CostModel, work: Workload, replicas: int) -> RolloutRate:
    """Groups per second `replicas` rollout replicas produce when never held back."""
    per_call = costs.gen(work.groups_per_generation * work.group_size)
    return RolloutRate(replicas * work.groups_per_generation / per_call)


def should_sync(trainer_step: int, sync_every: int) -> bool:
    """Send weights to rollout replicas after trainer step `trainer_step` (1-based)?"""
    return trainer_step % sync_every == 0


def may_make_group(
    group_position: int,
    rollout_version: int,
    max_staleness: int,
    prompts_per_step: int,
    stream_offset: int = 0,
) -> bool:
    """The `wait` staleness gate. Groups are trained oldest first, p per step, so the group at
    `group_position` of the rollout stream is trained at about version
    (position - stream_offset) // p, where stream_offset is the net count of stream positions the
    trainer will never train (groups dropped as stale, lost on a resume) minus the groups it trained
    from outside the stream (hybrid lending). A rollout process holding `rollout_version` may make the
    group only while that lag stays within `max_staleness`."""
    return group_position - stream_offset < (rollout_version + max_staleness + 1) * prompts_per_step


def stream_offset(skipped_groups: int, lent_groups_trained: int) -> int:
    """The `stream_offset` of may_make_group from the trainer's counters."""
    return skipped_groups - lent_groups_trained


def expected_wait_s(buffered_groups: int, needed_groups: int, rate: RolloutRate) -> float:
    """How long the trainer would wait for a full step's groups at the current rollout rate."""
    missing = max(0, needed_groups - buffered_groups)
    return missing / rate.groups_per_s if rate.groups_per_s > 0 else float("inf")


def should_lend(
    buffered_groups: int,
    in_flight_groups: int,
    prompts_per_step: int,
    lend_threshold: float,
    lent_call_s: float,
    rate: RolloutRate,
    train_step_s: float | None,
) -> bool:
    """Hybrid: lend the idle trainer replicas to rollout for one generation call?

    Only when rollout cannot keep up with training (at `rate` it makes fewer than a step's groups
    in the last measured training step, `train_step_s`; unknown before the first step), the buffer
    is low (below `lend_threshold` of a step) and the trainer would wait (counting the groups being
    generated) at least as long as the lent call, switching there and back included
    (`lent_call_s`): then lending costs no training time and adds the lent replicas' groups to the
    next steps. (When rollout keeps up, lent groups would only push the rollout stream's groups
    past the staleness bound.) Reclaiming is the same rule read the other way: the trainer lends
    one call at a time and trains as soon as a step's groups are there.
    """
    if train_step_s is None or rate.groups_per_s * train_step_s >= prompts_per_step:
        return False
    if buffered_groups >= lend_threshold * prompts_per_step:
        return False
    wait_s = expected_wait_s(buffered_groups + in_flight_groups, prompts_per_step, rate)
    return wait_s >= lent_call_s * (1 - 1e-9)  # equal (one group at one group's rate) despite rounding
