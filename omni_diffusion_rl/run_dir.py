"""The run folder (`train.output_dir`) at the start of a run: one run per folder, writable.

A new run into a folder that already holds a run would interleave two runs' checkpoints, erase
the first one's metrics and leave `latest` naming a checkpoint that pruning deletes. So a new
run refuses such a folder unless it resumes (`--resume`) or is told to start over
(`train.overwrite=true`, which deletes what a run writes there and nothing else).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from .config import ConfigError

# What a run writes into its folder; `train.overwrite=true` deletes exactly these.
RUN_OUTPUTS = (
    "checkpoints",
    "metrics.jsonl",
    "previews",
    "summary.json",
    "reward_curve.png",
    "wandb",
    "notebook",
)
RUN_OUTPUT_PATTERNS = ("failed_samples*.jsonl",)


def run_evidence(output_dir: Path) -> list[str]:
    """What in `output_dir` shows that a run already wrote there (empty: a fresh folder)."""
    found = []
    checkpoints = output_dir / "checkpoints"
    steps = sorted(p.name for p in checkpoints.glob("step_*")) if checkpoints.is_dir() else []
    if steps:
        found.append(f"checkpoints up to {steps[-1]}")
    metrics = output_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append("metrics.jsonl")
    if (output_dir / "summary.json").is_file():
        found.append("summary.json")
    return found


def clear_run_outputs(output_dir: Path) -> None:
    """Delete what a run writes into `output_dir` (and nothing else)."""
    for name in RUN_OUTPUTS:
        path = output_dir / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()
    for pattern in RUN_OUTPUT_PATTERNS:
        for path in output_dir.glob(pattern):
            path.unlink()


def check_writable(output_dir: Path) -> None:
    """Create the run folder and its checkpoints/ and prove a file can be written there, so a
    read-only or full location fails now and not at the first checkpoint."""
    target = output_dir / "checkpoints"
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=target, prefix=".write_check_") as probe:
            probe.write(b"ok")
            probe.flush()
    except OSError as e:
        raise ConfigError(
            f"train.output_dir={output_dir}: cannot write there ({e.strerror or e}); "
            "choose a writable train.output_dir=..."
        ) from e


def prepare_run_dir(output_dir: str | Path, resume: str | None, overwrite: bool, is_main: bool) -> None:
    """Refuse a folder that holds another run (unless resuming or overwriting), clear it when told
    to (main process only), and check that it is writable."""
    output_dir = Path(output_dir)
    if output_dir.exists() and not output_dir.is_dir():
        raise ConfigError(f"train.output_dir={output_dir} is a file; give a folder for the run")
    evidence = run_evidence(output_dir) if not resume else []
    if evidence and not overwrite:
        raise ConfigError(
            f"train.output_dir={output_dir} already holds a run ({', '.join(evidence)}). Continue it with "
            f"--resume {output_dir / 'checkpoints'}, start over with train.overwrite=true (deletes its "
            "checkpoints, metrics and previews), or choose another train.output_dir=..."
        )
    if evidence and is_main:
        clear_run_outputs(output_dir)
    if is_main:
        check_writable(output_dir)
