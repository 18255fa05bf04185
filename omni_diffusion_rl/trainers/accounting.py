"""Every generated sample is accounted for: trained, or dropped with a reason. The run's counts
(kept in checkpoints), each process's log of dropped samples, and a step's sample and reward
metrics."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..experience.rollout import Rollout
from ..reward import ScoreResult

SMALL_GROUP = "its prompt group has fewer than 2 scored samples"


def trainable_samples(ok: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: scored samples whose prompt group kept at least 2 scored samples."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    scored_per_group = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.long)
    scored_per_group.index_add_(0, inverse, ok.long())
    return ok & (scored_per_group[inverse] >= 2)


def failures_path(output_dir: Path, rank: int) -> Path:
    """A process's log of dropped samples (one file per process)."""
    suffix = "" if rank == 0 else f".rank{rank}"
    return output_dir / f"failed_samples{suffix}.jsonl"


def record_dropped(
    path: Path, step: int, rank: int, rollout: Rollout, scored: ScoreResult, keep: torch.Tensor
) -> None:
    """Append every sample of this process that `keep` drops, with its reason, to `path`."""
    lines = []
    for i in (~keep).nonzero().flatten().tolist():
        reason = scored.failures.get(i, SMALL_GROUP)
        record = {"step": step + 1, "rank": rank, "group": int(rollout.group_ids[i])}
        lines.append(json.dumps({**record, "prompt": rollout.prompts[i], "reason": reason}))
    if lines:
        with open(path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))


def count_samples(counts: dict[str, int], ok: torch.Tensor, keep: torch.Tensor) -> None:
    """Add a step's samples (all processes: `ok` scored, `keep` trained) to the run's `counts`."""
    step = {
        "generated": len(ok),
        "trained": int(keep.sum()),
        "dropped/reward_failed": int((~ok).sum()),
        "dropped/group_too_small": int((ok & ~keep).sum()),
    }
    for name, n in step.items():
        counts[name] = counts.get(name, 0) + n


def reward_metrics(
    rewards: torch.Tensor, parts: dict[str, torch.Tensor], keep: torch.Tensor
) -> dict[str, float]:
    """The mean and std of the trained samples' rewards, and each named part's mean over them."""
    kept = rewards[keep]
    nan = float("nan")
    out = {
        "reward/mean": float(kept.mean()) if len(kept) else nan,
        "reward/std": float(kept.std(correction=0)) if len(kept) else nan,
    }
    for name, gathered in parts.items():
        out[f"reward/{name}"] = float(gathered[keep].mean()) if keep.any() else nan
    return out
