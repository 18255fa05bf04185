"""Scheduling decisions as pure functions of state, for the simulator (virtual clock) and the
runtime (real clock): the sync schedule and the staleness gate are shared today; the hybrid
lending rule runs in the simulator until hybrid mode's runtime exists."""

from __future__ import annotations

from dataclasses import dataclass

from .costs import CostModel, Workload


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
    group_position: int, rollout_version: int, max_staleness: int, prompts_per_step: int
) -> bool:
    """The `wait` staleness gate: the group at `group_position` of the data stream is trained at about
    version position // prompts_per_step (groups are taken oldest first), so a rollout process holding
    `rollout_version` may make it only while that lag stays within `max_staleness`."""
    return group_position < (rollout_version + max_staleness + 1) * prompts_per_step


def expected_wait_s(buffered_groups: int, needed_groups: int, rate: RolloutRate) -> float:
    """How long the trainer would wait for a full step's groups at the current rollout rate."""
    missing = max(0, needed_groups - buffered_groups)
    return missing / rate.groups_per_s if rate.groups_per_s > 0 else float("inf")


def should_lend(
    buffered_groups: int, in_flight_groups: int, costs: CostModel, work: Workload, rate: RolloutRate
) -> bool:
    """Hybrid: lend the idle trainer replicas to rollout for one generation call?

    Only when the buffer is low (below `lend_threshold` of a step) and the trainer would wait
    (counting the groups being generated) at least as long as the lent call plus switching there and
    back: then lending costs no training time and adds the lent replicas' groups to the next steps.
    """
    if buffered_groups >= work.lend_threshold * work.prompts_per_step:
        return False
    lent_call = costs.gen(work.groups_per_generation * work.group_size) + 2 * costs.switch_s
    return expected_wait_s(buffered_groups + in_flight_groups, work.prompts_per_step, rate) >= lent_call
