"""Atomic checkpoints with a manifest, and their verification on load.

A checkpoint is a directory `step_XXXXXXX` holding the model's tensors (tensors.safetensors), the
training state (optimizer and RNG states: training_state.json + training_state.safetensors, see
state_codec; nothing is pickled) and a JSON trainer state (state.json). It is written under a
temporary name and renamed into place only when complete; `manifest.json` (written last) records
each file's size and sha256, so a truncated or edited checkpoint is refused with a clear error.
A checkpoint is untrusted input: loading never runs code from it, reads JSON with a size bound and
refuses manifests that name files outside the checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .state_codec import StateCodecError, decode_state, encode_state

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 1: optimizer and RNG states in a pickle (objects.pt), never unpickled now
MODEL_FILES = ("tensors.safetensors", "state.json")
TRAINING_FILES = ("training_state.json", "training_state.safetensors")
MAX_JSON_BYTES = 64 << 20
STEP_DIR = re.compile(r"step_\d{7}")


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

    tensors go to tensors.safetensors, objects (optimizer and RNG states) to training_state.json
    and training_state.safetensors, state to state.json. Pruning keeps the `keep_last`
    highest steps and always the one `latest` names.
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
    objects_tree, objects_tensors = encode_state(objects)
    save_file(objects_tensors, str(tmp / "training_state.safetensors"))
    (tmp / "training_state.json").write_text(json.dumps(objects_tree), encoding="utf-8")
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
    latest = _latest_name(root)
    for old in done[:-keep_last] if keep_last > 0 else []:
        if old.name != latest:
            shutil.rmtree(old, ignore_errors=True)
    for leftover in root.glob(".tmp_step_*"):  # from a save that crashed earlier
        shutil.rmtree(leftover, ignore_errors=True)


def _latest_name(root: Path) -> str | None:
    """The checkpoint folder `root/latest` names; refuses anything but a `step_XXXXXXX` name in root."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None
    name = read_bounded(pointer, 4096).decode("utf-8", errors="replace").strip()
    if not STEP_DIR.fullmatch(name):
        raise CheckpointError(
            f"{pointer} names {name[:80]!r}, not a step_XXXXXXX folder of {root}: a latest pointer may "
            "only name a checkpoint next to it. Pass the checkpoint folder itself, or fix the file"
        )
    return name


def read_bounded(path: Path, limit: int = MAX_JSON_BYTES) -> bytes:
    """The bytes of `path`, refusing files over `limit` bytes."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CheckpointError(f"{path} is larger than {limit} bytes; refusing to read it")
    return data


def _read_json(path: Path) -> Any:
    try:
        return json.loads(read_bounded(path).decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint was edited or damaged") from e


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the one that `path/latest` names."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a file; give a checkpoint folder or a run's checkpoints/"
        )
    latest = _latest_name(path)
    if latest is not None:
        path = path / latest
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); it may be from an interrupted save"
        )
    return path


def _verified_manifest(path: Path, needed: tuple[str, ...]) -> dict[str, Any]:
    """The manifest's file table, after checking its shape and the `needed` files' sizes and hashes."""
    manifest = _read_json(path / MANIFEST)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / MANIFEST} has no 'files' table; the checkpoint was edited or damaged")
    for name in needed:
        if name not in files:
            raise CheckpointError(f"checkpoint {path} is missing {name} (not in its manifest)")
    for name, meta in files.items():
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            raise CheckpointError(f"{path / MANIFEST} lists {name!r}, which is not a file of the checkpoint")
        ok = (
            isinstance(meta, dict)
            and isinstance(meta.get("bytes"), int)
            and isinstance(meta.get("sha256"), str)
        )
        if not ok:
            raise CheckpointError(f"{path / MANIFEST} has a malformed entry for {name}")
    for name in needed:  # only what this load reads: sampling never opens the training state
        meta, f = files[name], path / name
        if not f.is_file():
            raise CheckpointError(f"checkpoint {path} is missing {name}")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"checkpoint file {f} is truncated or corrupted (size/sha256 mismatch)")
    return files


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path} is not a readable safetensors file: {e}") from e


def load_checkpoint(
    path: str | Path, objects: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Verified (tensors, objects, state) of a checkpoint written by save_checkpoint.

    objects=False leaves the training state (optimizer and RNG states) unread and returns {} for
    it: sampling, evaluation and export need only the tensors and the JSON state. Nothing is
    unpickled either way; a checkpoint of format 1 (a pickled objects.pt) can be sampled from but
    not resumed."""
    path = resolve_checkpoint(path)
    state = _read_json(path / "state.json") if (path / "state.json").is_file() else None
    version = state.get("format") if isinstance(state, dict) else None
    if version not in (1, FORMAT_VERSION):
        raise CheckpointError(
            f"checkpoint {path} has format {version}; this version reads {FORMAT_VERSION} "
            "(and 1 for sampling)"
        )
    if objects and version == 1:
        raise CheckpointError(
            f"checkpoint {path} is from an earlier version that pickled its optimizer state (objects.pt); "
            "it is never unpickled. Sample or evaluate from it, or start a new run from its adapters"
        )
    _verified_manifest(path, MODEL_FILES + (TRAINING_FILES if objects else ()))
    state = _read_json(path / "state.json")  # re-read after verification: the file the hash covers
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / 'state.json'} is not a JSON object")
    tensors = _load_tensors(path / "tensors.safetensors")
    if not objects:
        return tensors, {}, state
    try:
        training = decode_state(
            _read_json(path / "training_state.json"), _load_tensors(path / "training_state.safetensors")
        )
    except StateCodecError as e:
        raise CheckpointError(f"checkpoint {path} has a malformed training state: {e}") from e
    return tensors, training, state
