"""Atomic checkpoints with a manifest, and their verification on load.

A checkpoint is a directory `step_XXXXXXX` holding tensors (safetensors), the optimizer state,
RNG states and a JSON trainer state. It is written under a temporary name and renamed into
place only when complete; `manifest.json` (written last) records each file's size and sha256,
so a truncated or edited checkpoint is refused with a clear error.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted or made for another model."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(
    root: str | Path,
    step: int,
    tensors: dict[str, torch.Tensor],
    objects: dict[str, Any],
    state: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write `root/step_{step:07d}` atomically and point `root/latest` at it.

    tensors go to tensors.safetensors, objects (optimizer and RNG states: our own data, never
    network input) to objects.pt, state to state.json.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:07d}"
    tmp = root / f".tmp_step_{step:07d}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    save_file(
        {k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / "tensors.safetensors")
    )
    torch.save(objects, tmp / "objects.pt")
    (tmp / "state.json").write_text(
        json.dumps({**state, "format": FORMAT_VERSION}, indent=1), encoding="utf-8"
    )
    files = {p.name: {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(tmp.iterdir())}
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1), encoding="utf-8")
    for p in tmp.iterdir():
        with open(p, "rb") as f:
            os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(root)
    atomic_write_text(root / "latest", final.name + "\n")
    _prune(root, keep_last)
    return final


def _prune(root: Path, keep_last: int) -> None:
    done = sorted(p for p in root.glob("step_*") if (p / MANIFEST).is_file())
    for old in done[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".tmp_step_*"):  # from a save that crashed earlier
        shutil.rmtree(leftover, ignore_errors=True)


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the one that `path/latest` names."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if (path / "latest").is_file():
        path = path / (path / "latest").read_text(encoding="utf-8").strip()
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); it may be from an interrupted save"
        )
    return path


def load_checkpoint(
    path: str | Path, objects: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Verified (tensors, objects, state) of a checkpoint written by save_checkpoint.

    objects=False leaves objects.pt (optimizer and RNG states, a pickle) unread and returns {} for
    it: sampling and evaluation need only the tensors and the JSON state, so a checkpoint someone
    shared cannot run code through them."""
    path = resolve_checkpoint(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
        expected = manifest["files"]
    except (json.JSONDecodeError, KeyError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path / MANIFEST} is unreadable: {e}") from e
    for name, meta in expected.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupted (size/sha256 mismatch)")
    state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    if state.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path} has format {state.get('format')}; this version reads {FORMAT_VERSION}"
        )
    tensors = load_file(str(path / "tensors.safetensors"))
    if not objects:
        return tensors, {}, state
    return tensors, torch.load(path / "objects.pt", weights_only=False), state
