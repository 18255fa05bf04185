"""Rules for the layout of an asynchronous run (separate / hybrid / auto), as pure functions.

Config loading checks them (`config.check_consistency`), and so do the cost model and the runtime;
they live here, below all of those, so the config imports nothing above it.
"""

from __future__ import annotations


def buffer_capacity(buffer_groups: int, prompts_per_step: int) -> int:
    """The configured capacity in prompt groups, or 2 steps' worth when it is 0."""
    return buffer_groups or 2 * prompts_per_step


def check_async_layout(sync_every: int, max_staleness: int, capacity: int, prompts_per_step: int) -> None:
    """Layouts under which separate/hybrid cannot make progress are refused (ValueError)."""
    if sync_every > max_staleness + 1:
        raise ValueError(
            f"sync_every={sync_every} > max_staleness + 1 = {max_staleness + 1}: between two weight syncs "
            "everything the rollout makes would be stale; sync more often or allow more staleness"
        )
    if capacity < prompts_per_step:
        raise ValueError(
            f"the buffer holds {capacity} prompt groups, fewer than a step's {prompts_per_step}: "
            "no step could start"
        )
