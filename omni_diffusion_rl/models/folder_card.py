"""What a model folder says about itself beside its weights, which `odrl pretrain` writes and a
teacher reads: its recommended classifier-free guidance (`guidance.json`, `{"cfg_scale": 3.0}`) and,
for a model trained on some parts of the latent only, those parts (`trained_parts.json`,
`{"parts": ["picture", "visibility"]}`). Both are read as untrusted input: small, the one key, a
bounded value, or an error that names the file."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..teacher import part_names_problem

GUIDANCE_FILE = "guidance.json"
TRAINED_PARTS_FILE = "trained_parts.json"
MAX_GUIDANCE = 20.0
_MAX_BYTES = 1024


class FolderCardError(ValueError):
    """A guidance.json or trained_parts.json that is not what it should hold; names the file and the fix."""


def write_folder_guidance(folder: str | Path, cfg_scale: float) -> Path:
    """Record `cfg_scale` as the folder's recommended guidance (checked like a read one)."""
    return _write(Path(folder) / GUIDANCE_FILE, {"cfg_scale": float(cfg_scale)}, checked_guidance)


def read_folder_guidance(folder: str | Path) -> float | None:
    """The folder's recommended guidance, or None when it declares none (or is not a folder)."""
    path = Path(folder) / GUIDANCE_FILE
    data = _read(path, '{"cfg_scale": 3.0}')
    return None if data is None else checked_guidance(data, path)


def write_trained_parts(folder: str | Path, parts: list[str]) -> Path:
    """Record the parts of the latent the folder's model was trained on (the others are untrained)."""
    return _write(Path(folder) / TRAINED_PARTS_FILE, {"parts": list(parts)}, _checked_parts)


def read_trained_parts(folder: str | Path) -> tuple[str, ...] | None:
    """The parts the folder's model was trained on, or None: every part (or not a folder)."""
    path = Path(folder) / TRAINED_PARTS_FILE
    data = _read(path, '{"parts": ["picture", "visibility"]}')
    return None if data is None else _checked_parts(data, path)


def _write(path: Path, data: dict[str, object], check: object) -> Path:
    check(json.loads(json.dumps(data)), path)  # type: ignore[operator]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data) + "\n")
    return path


def _read(path: Path, example: str) -> object | None:
    if not path.is_file():
        return None
    with path.open("rb") as f:
        raw = f.read(_MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise FolderCardError(f"{path}: over {_MAX_BYTES} bytes; write {example}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as e:  # deep, huge
        raise FolderCardError(f"{path}: not JSON ({e}); write {example} or delete it") from e


def checked_guidance(data: object, path: Path) -> float:
    """`data` as a guidance.json must hold it: {"cfg_scale": a number in [1, MAX_GUIDANCE]}."""
    if not isinstance(data, dict) or set(data) != {"cfg_scale"}:
        raise FolderCardError(f'{path}: give exactly {{"cfg_scale": <number>}}; got {str(data)[:80]}')
    scale = data["cfg_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not _finite(scale):
        raise FolderCardError(f"{path}: cfg_scale must be a finite number; got {scale!r}")
    if not 1.0 <= scale <= MAX_GUIDANCE:
        raise FolderCardError(f"{path}: cfg_scale {scale} is outside [1, {MAX_GUIDANCE:g}] (1 is off)")
    return float(scale)


def _finite(number: float) -> bool:
    try:
        return math.isfinite(float(number))
    except OverflowError:  # an integer too large for a float
        return False


def _checked_parts(data: object, path: Path) -> tuple[str, ...]:
    if not isinstance(data, dict) or set(data) != {"parts"}:
        raise FolderCardError(f'{path}: give exactly {{"parts": [<part>, ...]}}; got {str(data)[:80]}')
    parts = data["parts"]
    problem = part_names_problem(parts)
    if problem:
        raise FolderCardError(f"{path}: {problem}")
    return tuple(parts)
