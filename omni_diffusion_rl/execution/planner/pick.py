"""The rules auto decides by, used by auto's first pick, its re-checks and `odrl simulate`: which
mode to start with (pick_mode) and whether to leave the running one (next_mode). Both compare
steady seconds per trained prompt (after the first step, which an async buffer spends filling up)
and ask another mode to be faster by more than a margin (execution.auto_switch_margin), the
simulator's error on a short warm-up being of that order."""

from __future__ import annotations

import math


def next_mode(
    predicted: dict[str, float], current: str, remaining_prompts: int, switch_cost_s: float, margin: float
) -> tuple[str, str]:
    """(the mode to run next, why): the fastest predicted mode if it beats the running one by more
    than `margin` (a fraction) and saves more than `switch_cost_s` over the remaining prompts."""
    best = min(predicted, key=predicted.get)
    now, new = predicted[current], predicted[best]
    if best == current:
        return current, "the running mode is still predicted fastest"
    if not math.isfinite(new):
        return current, "no mode is predicted to run"
    if not math.isfinite(now):
        return best, f"{best} is predicted to run, the running layout is not"
    if new > now * (1 - margin):
        return current, f"{best} is predicted {100 * (1 - new / now):.1f}% faster, within the margin"
    saved = (now - new) * remaining_prompts
    if saved <= switch_cost_s:
        return current, f"{best} would save {saved:.1f} s, less than the switch ({switch_cost_s:.1f} s)"
    return best, f"{best} is predicted {100 * (1 - new / now):.1f}% faster, saving {saved:.1f} s"


def pick_mode(predicted: dict[str, float], margin: float) -> str:
    """The mode to start with: colocated (on-policy, no buffer to fill) unless another mode is
    predicted faster by more than `margin`, the simulator's error on a short warm-up being of that
    order; otherwise the fastest."""
    best = min(predicted, key=predicted.get)
    colocated = predicted.get("colocated", math.inf)
    return "colocated" if math.isfinite(colocated) and predicted[best] > colocated * (1 - margin) else best
