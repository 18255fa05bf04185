"""A model folder's own recommended classifier-free guidance (`guidance.json`), which a teacher uses
when none is given: `{"cfg_scale": 3.0}`. Written by `odrl pretrain` for a model trained with prompt
dropout; read as untrusted input (small, one bounded number, nothing else)."""

from __future__ import annotations

import json
import math
from pathlib import Path

GUIDANCE_FILE = "guidance.json"
MAX_GUIDANCE = 20.0
_MAX_BYTES = 1024


class FolderGuidanceError(ValueError):
    """A guidance.json that is not one bounded number; names the file and the fix."""


def write_folder_guidance(folder: str | Path, cfg_scale: float) -> Path:
    """Record `cfg_scale` as the folder's recommended guidance (checked like a read one)."""
    path = Path(folder) / GUIDANCE_FILE
    text = json.dumps({"cfg_scale": float(cfg_scale)})
    _checked(json.loads(text), path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    return path


def read_folder_guidance(folder: str | Path) -> float | None:
    """The folder's recommended guidance, or None when it declares none (or is not a folder)."""
    path = Path(folder) / GUIDANCE_FILE
    if not path.is_file():
        return None
    with path.open("rb") as f:
        raw = f.read(_MAX_BYTES + 1)
    if len(raw) > _MAX_BYTES:
        raise FolderGuidanceError(f'{path}: over {_MAX_BYTES} bytes; write {{"cfg_scale": 3.0}}')
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FolderGuidanceError(f'{path}: not JSON ({e}); write {{"cfg_scale": 3.0}} or delete it') from e
    return _checked(data, path)


def _checked(data: object, path: Path) -> float:
    if not isinstance(data, dict) or set(data) != {"cfg_scale"}:
        raise FolderGuidanceError(f'{path}: give exactly {{"cfg_scale": <number>}}; got {str(data)[:80]}')
    scale = data["cfg_scale"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise FolderGuidanceError(f"{path}: cfg_scale must be a finite number; got {scale!r}")
    if not 1.0 <= scale <= MAX_GUIDANCE:
        raise FolderGuidanceError(f"{path}: cfg_scale {scale} is outside [1, {MAX_GUIDANCE:g}] (1 is off)")
    return float(scale)
