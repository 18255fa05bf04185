"""Atomic checkpoints with a manifest, and their verification on load.

A checkpoint is a directory `step_XXXXXXX` holding the model's tensors (tensors.safetensors), the
training state (optimizer and RNG states: training_state.json + training_state.safetensors, see
state_codec; nothing is pickled) and a JSON trainer state (state.json). It is written under a
temporary name and renamed into place only when complete; `manifest.json` (written last) records
each file's size and sha256, so a truncated or edited checkpoint is refused with a clear error.

A checkpoint is untrusted input (the trust boundary, docs/checkpoints.md): loading
never runs code from it; every JSON file is read with a size and a nesting bound before it is
parsed; and the fields a command uses are checked for type and range here (`checkpoint_model`,
`checkpoint_sampling`, `resume_fields`, `check_training_objects`, `check_execution_state`), each
failure a CheckpointError that names the field. A checkpoint says which model it is (the model
section of its config) and how it samples; it never chooses a server, a token, a file to read or
a plug-in: those come from the user's config and command line only.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import reprlib
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .bounded_json import nesting_exceeds
from .config import MAX_LORA_RANK as MAX_LORA_RANK  # bounds shared with configs (re-exported)
from .config import MAX_SAMPLING_STEPS, MAX_STEP
from .state_codec import StateCodecError, decode_state, encode_state

if TYPE_CHECKING:
    from .config import ModelConfig, SamplingConfig

MANIFEST = "manifest.json"
FORMAT_VERSION = 2  # 1: optimizer and RNG states in a pickle (objects.pt), never unpickled now
MODEL_FILES = ("tensors.safetensors", "state.json")
TRAINING_FILES = ("training_state.json", "training_state.safetensors")
MAX_JSON_BYTES = 64 << 20  # training_state.json (the optimizer's numbers live in safetensors)
MAX_STATE_BYTES = 16 << 20  # state.json: step, counters, config
MAX_MANIFEST_BYTES = 1 << 20
MAX_JSON_DEPTH = 32  # what the toolkit writes nests at most 8 deep
MAX_MANIFEST_FILES = 64
STEP_DIR = re.compile(r"step_\d{7}")

MAX_COUNT = 2**53
"""Sample counters and stream positions: exact as floats, far beyond any run."""
MAX_TEXT = 1024
"""Characters of a name or path a checkpoint records (model.pretrained, a LoRA target, an option)."""
MAX_LIST = 256
"""Entries of a list or table a checkpoint records (LoRA targets, options, counters, metrics)."""
MAX_METRICS = 4096
"""Entries of the held-out result a checkpoint records (eval_before)."""
MAX_OPTION_INT = 2**31 - 1
"""Largest magnitude of an integer in model.options (clip sizes: the latent is bounded again when built)."""
BUILTIN_MODELS = ("builtin", "builtin-omni", "builtin-teacher")

_SHA256 = re.compile(r"[0-9a-f]{64}")
_RUN_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,95}(/[A-Za-z0-9][A-Za-z0-9_.-]{0,95})?")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupted, edited or made for another model."""


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


def _complete_checkpoints(root: Path) -> list[Path]:
    """The step_XXXXXXX folders of `root` that hold a manifest (a finished save), oldest first."""
    return sorted(p for p in root.iterdir() if STEP_DIR.fullmatch(p.name) and (p / MANIFEST).is_file())


def _prune(root: Path, keep_last: int) -> None:
    done = _complete_checkpoints(root)
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


# ------------------------------------------------------------------------------------ bounded JSON
def read_json(path: Path, limit: int = MAX_JSON_BYTES, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """A checkpoint's JSON file, at most `limit` bytes and `max_depth` levels deep. The depth is
    checked before parsing, so no file reaches Python's recursion limit; a file over either bound,
    not UTF-8 or not JSON is a CheckpointError."""
    try:
        data = read_bounded(path, limit)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e}") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointError(
            f"{path} is not UTF-8 text ({e.reason} at byte {e.start}); the checkpoint was edited or damaged"
        ) from e
    if nesting_exceeds(text, max_depth):
        raise CheckpointError(
            f"{path} nests lists and objects more than {max_depth} deep, which no checkpoint does; the "
            "checkpoint was edited or damaged"
        )
    try:
        return json.loads(text)
    except ValueError as e:  # JSONDecodeError, or an integer too long to convert
        raise CheckpointError(f"{path} is not valid JSON ({e}); the checkpoint was edited or damaged") from e


# ------------------------------------------------------------------------------------ files
def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory, or the one that `path/latest` names; a run's checkpoints/ without a
    `latest` (a run killed between its first checkpoint's rename and the pointer's write) gives its
    newest complete step folder."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a file; give a checkpoint folder or a run's checkpoints/"
        )
    latest = _latest_name(path)
    if latest is None and not (path / MANIFEST).is_file():
        complete = _complete_checkpoints(path)
        latest = complete[-1].name if complete else None
    if latest is not None:
        path = path / latest
    if not (path / MANIFEST).is_file():
        raise CheckpointError(
            f"{path} is not a complete checkpoint (no {MANIFEST}); it may be from an interrupted save"
        )
    return path


def _check_manifest_entry(manifest: Path, name: Any, meta: Any) -> None:
    """A file-table entry: a plain file name of the checkpoint with its size and sha256."""
    plain = isinstance(name, str) and name.isprintable() and Path(name).name == name
    if not plain or name in ("", ".", ".."):
        raise CheckpointError(f"{manifest} lists {str(name)[:80]!r}, which is not a file of the checkpoint")
    ok = (
        isinstance(meta, dict)
        and _is_int(meta.get("bytes"))
        and meta["bytes"] >= 0
        and isinstance(meta.get("sha256"), str)
        and _SHA256.fullmatch(meta["sha256"]) is not None
    )
    if not ok:
        raise CheckpointError(
            f"{manifest} has a malformed entry for {name} (it needs bytes >= 0 and a 64-hex-digit sha256)"
        )


def _verified_manifest(path: Path, needed: tuple[str, ...]) -> dict[str, Any]:
    """The manifest's file table, after checking its shape and the `needed` files' sizes and hashes."""
    manifest = read_json(path / MANIFEST, MAX_MANIFEST_BYTES)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path / MANIFEST} has no 'files' table; the checkpoint was edited or damaged")
    if len(files) > MAX_MANIFEST_FILES:
        raise CheckpointError(f"{path / MANIFEST} lists {len(files)} files; a checkpoint has a handful")
    for name in needed:
        if name not in files:
            raise CheckpointError(f"checkpoint {path} is missing {name} (not in its manifest)")
    for name, meta in files.items():
        _check_manifest_entry(path / MANIFEST, name, meta)
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


def _format_of(path: Path, state: Any = None) -> int:
    """The format version state.json records (read before verification when `state` is not given:
    a format-1 checkpoint lacks the training files, and says so rather than that they are missing)."""
    if state is None and (path / "state.json").is_file():
        state = read_json(path / "state.json", MAX_STATE_BYTES)
    version = state.get("format") if isinstance(state, dict) else None
    if not _is_int(version) or version not in (1, FORMAT_VERSION):
        raise CheckpointError(
            f"checkpoint {path} has format {_show(version)}; this version reads {FORMAT_VERSION} "
            "(and 1 for sampling)"
        )
    return version


def _decoded_training_state(path: Path) -> dict[str, Any]:
    tree = read_json(path / "training_state.json")
    tensors = _load_tensors(path / "training_state.safetensors")
    try:
        training = decode_state(tree, tensors)
    except (StateCodecError, TypeError, ValueError) as e:  # TypeError: numpy's "data type not understood"
        raise CheckpointError(f"checkpoint {path} has a malformed training state: {e}") from e
    if not isinstance(training, dict):
        raise CheckpointError(f"checkpoint {path} has a training state that is not a table of states")
    return training


def load_checkpoint(
    path: str | Path, objects: bool = True
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """Verified (tensors, objects, state) of a checkpoint written by save_checkpoint.

    objects=False leaves the training state (optimizer and RNG states) unread and returns {} for
    it: sampling, evaluation and export need only the tensors and the JSON state. Nothing is
    unpickled either way; a checkpoint of format 1 (a pickled objects.pt) can be sampled from but
    not resumed. The files are checked (manifest, sizes, hashes, JSON bounds, state.json's step);
    the fields each command uses are checked by the functions below."""
    path = resolve_checkpoint(path)
    if _format_of(path) == 1 and objects:
        raise CheckpointError(
            f"checkpoint {path} is from an earlier version that pickled its optimizer state (objects.pt); "
            "it is never unpickled. Sample or evaluate from it, or start a new run from its adapters"
        )
    _verified_manifest(path, MODEL_FILES + (TRAINING_FILES if objects else ()))
    state = read_json(path / "state.json", MAX_STATE_BYTES)  # re-read: the file the hash covers
    if not isinstance(state, dict):
        raise CheckpointError(f"{path / 'state.json'} is not a JSON object")
    _format_of(path, state)
    checkpoint_step(state, path)
    tensors = _load_tensors(path / "tensors.safetensors")
    return tensors, _decoded_training_state(path) if objects else {}, state


# ------------------------------------------------------------------------------------ fields
def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _show(value: Any) -> str:
    """A short repr of a value read from a checkpoint (never a whole nested table)."""
    return reprlib.repr(value)


def _refuse(path: Path | str, key: str, value: Any, rule: str) -> CheckpointError:
    return CheckpointError(
        f"checkpoint {path}: {key} is {_show(value)}; {rule}. The checkpoint was edited, damaged or "
        "written by something else; use one written by odrl train"
    )


def _int_field(value: Any, key: str, path: Path | str, low: int, high: int) -> int:
    if not _is_int(value) or not low <= value <= high:
        raise _refuse(path, key, value, f"it must be an integer from {low} to {high}")
    return value


def _count(value: Any, key: str, path: Path | str) -> int:
    return _int_field(value, key, path, 0, MAX_COUNT)


def _table(value: Any, key: str, path: Path | str, limit: int = MAX_LIST) -> dict[str, Any]:
    """A JSON object with at most `limit` short printable string keys."""
    if not isinstance(value, dict):
        raise _refuse(path, key, value, "it must be a table (a JSON object)")
    if len(value) > limit:
        raise _refuse(path, key, f"{len(value)} entries", f"it may hold at most {limit}")
    for name in value:
        if not isinstance(name, str) or not name.isprintable() or len(name) > MAX_TEXT:
            raise _refuse(
                path, f"a key of {key}", name, f"keys are printable names of at most {MAX_TEXT} characters"
            )
    return value


def _bounded(value: Any, key: str, path: Path | str) -> None:
    """Every string of a JSON value at most MAX_TEXT characters, every list and table at most MAX_LIST
    entries (the depth is bounded by read_json), so no message or config built from it is large."""
    if isinstance(value, str) and len(value) > MAX_TEXT:
        raise _refuse(path, key, value, f"a checkpoint's text is at most {MAX_TEXT} characters")
    if isinstance(value, list):
        if len(value) > MAX_LIST:
            raise _refuse(path, key, f"{len(value)} entries", f"it may hold at most {MAX_LIST}")
        for i, item in enumerate(value):
            _bounded(item, f"{key}[{i}]", path)
    if isinstance(value, dict):
        for name, item in _table(value, key, path).items():
            _bounded(item, f"{key}.{name}", path)


def checkpoint_step(state: dict[str, Any], path: Path | str) -> int:
    """The step state.json records: an integer from 0 to MAX_STEP."""
    if "step" not in state:
        raise CheckpointError(
            f"checkpoint {path}: state.json records no step; the checkpoint was edited or damaged"
        )
    return _int_field(state["step"], "step", path, 0, MAX_STEP)


def _config_section(state: dict[str, Any], name: str, path: Path | str) -> dict[str, Any] | None:
    """config.<name> of state.json as a bounded table, or None when the config has no such section."""
    config = state.get("config")
    if config is None:
        return None
    _table(config, "config", path)
    section = config.get(name)
    if section is None:
        return None
    _bounded(section, f"config.{name}", path)
    return _table(section, f"config.{name}", path)


def _checked_section(section: dict[str, Any], name: str, path: Path | str) -> Any:
    """A config section as config.py checks a config file's (types, ranges, choices, registered
    names), with the other sections at their defaults."""
    from .config import ConfigError, config_from_dict

    try:
        return getattr(config_from_dict({name: section, "eval": {"metrics": []}}), name)
    except ConfigError as e:
        raise CheckpointError(
            f"checkpoint {path}: its recorded config is refused: {str(e)[:600]}. The checkpoint was "
            "edited, damaged or written by another version"
        ) from e


def checkpoint_model(state: dict[str, Any], path: Path | str) -> ModelConfig:
    """The model a checkpoint's adapters belong to (config.model of state.json: family, base, LoRA
    layout, options), checked like a config file's and bounded: rank <= MAX_LORA_RANK, option
    values plain and bounded, model.pretrained a builtin name, a directory or a hub id."""
    section = _config_section(state, "model", path)
    if section is None:
        raise CheckpointError(
            f"checkpoint {path}: state.json records no model configuration (config.model); was it "
            "written by odrl train?"
        )
    model = _checked_section(section, "model", path)  # its range checks bound the rank (MAX_LORA_RANK)
    check_pretrained(model.pretrained, path)
    for i, target in enumerate(model.lora_targets):
        if not target or not target.isprintable():
            raise _refuse(path, f"model.lora_targets[{i}]", target, "a target is a module name")
    for name, value in model.options.items():
        _check_option(value, f"model.options.{name}", path)
    return model


def check_pretrained(pretrained: str, path: Path | str) -> None:
    """A checkpoint's model.pretrained: a builtin model, a directory, or a hub id (org/name). It is
    only ever given to the family's loader (and checked against the fingerprint after), never read
    as a file of prompts or sent anywhere; a file, a URL or anything else is refused."""
    if pretrained in BUILTIN_MODELS:
        return
    if not pretrained.isprintable() or not pretrained.strip():
        raise _refuse(path, "model.pretrained", pretrained, "it must name a model")
    local = Path(pretrained)
    if local.is_dir():
        return
    if local.exists() or not _HUB_ID.fullmatch(pretrained) or ".." in pretrained:
        raise _refuse(
            path,
            "model.pretrained",
            pretrained,
            "a checkpoint's base must be a builtin model, a model directory or a hub id (org/name), "
            "never a file or a URL; use a checkpoint that names the base it was trained on",
        )


def _check_option(value: Any, key: str, path: Path | str) -> None:
    """A family option from a checkpoint: null, a boolean, a finite number (integers within
    MAX_OPTION_INT) or a short string."""
    if value is None or isinstance(value, (bool, str)):
        return
    if _is_int(value) and abs(value) <= MAX_OPTION_INT:
        return
    if isinstance(value, float) and math.isfinite(value):
        return
    raise _refuse(
        path,
        key,
        value,
        f"a checkpoint's model options are null, booleans, finite numbers up to {MAX_OPTION_INT} or text",
    )


def checkpoint_sampling(state: dict[str, Any], path: Path | str) -> SamplingConfig:
    """How the checkpoint's run sampled (config.sampling; the defaults when it records none), checked
    like a config file's, with at most MAX_SAMPLING_STEPS sampler steps."""
    from .config import SamplingConfig

    section = _config_section(state, "sampling", path)
    if section is None:
        return SamplingConfig()
    sampling = _checked_section(section, "sampling", path)
    for key in ("num_steps", "eval_num_steps"):
        _int_field(getattr(sampling, key), f"sampling.{key}", path, 1, MAX_SAMPLING_STEPS)
    return sampling


# ------------------------------------------------------------------------------------ resume
@dataclass(frozen=True)
class ResumeFields:
    """What --resume takes from state.json besides the tensors: all checked."""

    step: int
    eval_before: dict[str, float | None] | None
    sample_counts: dict[str, int]
    wandb_run_id: str | None
    train_seconds: float = 0.0


MAX_TRAIN_SECONDS = 1e9
"""The most training seconds a checkpoint may record (about 31 years)."""


def resume_fields(state: dict[str, Any], path: Path | str) -> ResumeFields:
    """The step, the held-out result before training, the sample counters, the wandb run id and the
    training seconds so far of state.json, each checked for type and range (a checkpoint written
    before the seconds were kept counts from 0)."""
    eval_before = state.get("eval_before")
    if eval_before is not None:
        for name, value in _table(eval_before, "eval_before", path, MAX_METRICS).items():
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise _refuse(path, f"eval_before.{name}", value, "held-out results are numbers or null")
    counts = _table(state.get("sample_counts", {}), "sample_counts", path)
    for name, value in counts.items():
        _count(value, f"sample_counts.{name}", path)
    run_id = state.get("wandb_run_id")
    if run_id not in (None, "") and (not isinstance(run_id, str) or not _RUN_ID.fullmatch(run_id)):
        raise _refuse(path, "wandb_run_id", run_id, "a run id is 1 to 64 letters, digits, - or _")
    seconds = state.get("train_seconds", 0.0)
    if not _is_number(seconds) or not 0 <= seconds <= MAX_TRAIN_SECONDS:
        rule = f"it must be a number of seconds from 0 to {MAX_TRAIN_SECONDS:g}"
        raise _refuse(path, "train_seconds", seconds, rule)
    return ResumeFields(
        checkpoint_step(state, path), eval_before, dict(counts), run_id or None, float(seconds)
    )


def check_execution_state(state: dict[str, Any], path: Path | str) -> None:
    """The separate/hybrid modes' section (execution: the buffer's counters and the stream's
    position), when state.json has one."""
    section = state.get("execution")
    if section is None:
        return
    section = _table(section, "execution", path)
    for key in ("stream_next", "lent_made", "lent_trained"):
        _count(section.get(key), f"execution.{key}", path)
    buffer = _table(section.get("buffer"), "execution.buffer", path)
    stats = _table(buffer.get("stats"), "execution.buffer.stats", path)
    for key in ("generated", "trained", "taken"):
        _count(stats.get(key), f"execution.buffer.stats.{key}", path)
    for reason, n in _table(stats.get("dropped"), "execution.buffer.stats.dropped", path).items():
        _count(n, f"execution.buffer.stats.dropped.{reason}", path)
    histogram = _table(stats.get("staleness_histogram"), "execution.buffer.stats.staleness_histogram", path)
    for lag, n in histogram.items():
        if not re.fullmatch(r"\d{1,15}", lag):
            raise _refuse(
                path, "a key of execution.buffer.stats.staleness_histogram", lag, "it must be a lag"
            )
        _count(n, f"execution.buffer.stats.staleness_histogram.{lag}", path)
    waiting = buffer.get("waiting")
    if not isinstance(waiting, list) or len(waiting) > MAX_COUNT:
        raise _refuse(path, "execution.buffer.waiting", waiting, "it must be a list of groups")
    for i, group in enumerate(waiting):
        if not isinstance(group, list) or len(group) != 3:
            raise _refuse(path, f"execution.buffer.waiting[{i}]", group, "a group is [id, version, size]")
        for item in group:
            _count(item, f"execution.buffer.waiting[{i}]", path)


# ------------------------------------------------------------------------------------ training state
TRAINING_OBJECTS = ("optimizer", "torch_rng", "python_rng", "numpy_rng")
ADAPTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
"""The dtypes trained tensors (adapters, optimizer moments) may be stored in."""


def check_training_objects(
    objects: dict[str, Any], optimizer: torch.optim.Optimizer, path: Path | str
) -> None:
    """The training state of a checkpoint fits `optimizer` and this interpreter's RNGs: exactly the
    optimizer, torch, Python and numpy states, each of the right type, shape and range."""
    if sorted(objects) != sorted(TRAINING_OBJECTS):
        raise _refuse(
            path,
            "the training state's entries",
            sorted(objects),
            f"they must be {', '.join(TRAINING_OBJECTS)}",
        )
    _check_torch_rng(objects["torch_rng"], path)
    _check_python_rng(objects["python_rng"], path)
    _check_numpy_rng(objects["numpy_rng"], path)
    check_optimizer_state(objects["optimizer"], optimizer, path)


def _check_torch_rng(value: Any, path: Path | str) -> None:
    expected = torch.get_rng_state()
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.shape != expected.shape:
        raise _refuse(path, "torch_rng", value, f"it must be a uint8 tensor of {expected.numel()} bytes")


def _check_python_rng(value: Any, path: Path | str) -> None:
    version, internal, gauss = random.getstate()
    ok = (
        isinstance(value, tuple)
        and len(value) == 3
        and value[0] == version
        and isinstance(value[1], tuple)
        and len(value[1]) == len(internal)
        and all(_is_int(w) and 0 <= w < 2**32 for w in value[1])
        and value[1][-1] <= len(internal) - 1
        and (value[2] is None or isinstance(value[2], float))
    )
    if not ok:
        raise _refuse(
            path, "python_rng", value, f"it must be random.getstate()'s (3, {len(internal)} words, None)"
        )


def _check_numpy_rng(value: Any, path: Path | str) -> None:
    ok = (
        isinstance(value, tuple)
        and len(value) == 5
        and value[0] == "MT19937"
        and isinstance(value[1], np.ndarray)
        and value[1].dtype == np.uint32
        and value[1].shape == (624,)
        and _is_int(value[2])
        and 0 <= value[2] <= 624
        and value[3] in (0, 1)
        and not isinstance(value[3], float)
        and isinstance(value[4], (int, float))
        and math.isfinite(value[4])
    )
    if not ok:
        raise _refuse(path, "numpy_rng", value, "it must be numpy.random.get_state()'s MT19937 state")


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, path: Path | str) -> None:
    """An optimizer state dict that fits `optimizer`: the same groups and parameters; group settings
    whose numbers are finite and whose switches equal this optimizer's; per-parameter states with
    exactly the keys this optimizer keeps, finite floating tensors of the parameter's shape (or
    non-negative scalars: step counts), second moments non-negative."""
    if not isinstance(saved, dict) or sorted(saved) != ["param_groups", "state"]:
        raise _refuse(path, "optimizer", saved, "it must hold state and param_groups")
    groups, current = saved["param_groups"], optimizer.state_dict()["param_groups"]
    if not isinstance(groups, list) or len(groups) != len(current):
        raise _refuse(
            path, "optimizer.param_groups", groups, f"this run's optimizer has {len(current)} groups"
        )
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids: list[Any] = []
    for i, (group, mine) in enumerate(zip(groups, current, strict=True)):
        _check_param_group(group, mine, f"optimizer.param_groups[{i}]", path)
        ids += group["params"]
    if not all(_is_int(k) for k in ids) or len(set(ids)) != len(ids):
        raise _refuse(path, "optimizer.param_groups' params", ids, "they must be distinct parameter numbers")
    by_id = dict(zip(ids, params, strict=True))
    if not isinstance(saved["state"], dict):
        raise _refuse(path, "optimizer.state", saved["state"], "it must be a table by parameter number")
    layout = _state_layout(optimizer)
    for key, entry in saved["state"].items():
        if key not in by_id:
            raise _refuse(path, "a key of optimizer.state", key, "it must be a parameter of a group")
        _check_param_state(entry, by_id[key], layout, f"optimizer.state.{key}", path)


def _check_param_group(group: Any, mine: dict[str, Any], key: str, path: Path | str) -> None:
    """A saved group: this optimizer's settings, of which only switches (booleans, None: torch fills
    those in) may be missing."""
    needed = {k for k, v in mine.items() if k == "params" or not (v is None or isinstance(v, bool))}
    if not isinstance(group, dict) or not needed <= set(group) <= set(mine):
        raise _refuse(
            path, key, group, f"a group holds params and this optimizer's settings ({', '.join(mine)})"
        )
    if not isinstance(group["params"], list) or len(group["params"]) != len(mine["params"]):
        raise _refuse(
            path, f"{key}.params", group["params"], f"this run's group has {len(mine['params'])} parameters"
        )
    for name, value in group.items():
        if name != "params" and not _fits_setting(value, mine[name]):
            raise _refuse(
                path,
                f"{key}.{name}",
                value,
                f"this optimizer's {name} is {mine[name]!r}: a number may change (finite), a switch may not",
            )


def _is_number(value: Any) -> bool:
    return (_is_int(value) and abs(value) < 2**63) or (isinstance(value, float) and math.isfinite(value))


def _fits_setting(value: Any, mine: Any) -> bool:
    """A saved group setting where this optimizer has `mine`: a finite number for a number (not
    negative where `mine` is not), numbers of the same count for a tuple, the very value for anything
    else (a switch, a mode)."""
    if _is_number(mine):
        return _is_number(value) and (mine < 0 or value >= 0)
    if isinstance(mine, (tuple, list)):
        same = isinstance(value, (tuple, list)) and len(value) == len(mine)
        return same and all(_fits_setting(v, m) for v, m in zip(value, mine, strict=True))
    return type(value) is type(mine) and value == mine


def _state_layout(optimizer: torch.optim.Optimizer) -> dict[str, bool]:
    """The per-parameter state keys this optimizer keeps, each -> whether it is a scalar: one step of
    a twin (same class and settings) on a probe parameter."""
    import inspect

    accepted = inspect.signature(type(optimizer).__init__).parameters
    probe = torch.nn.Parameter(torch.zeros(2))
    twin = type(optimizer)([probe], **{k: v for k, v in optimizer.defaults.items() if k in accepted})
    probe.grad = torch.zeros(2)
    twin.step()
    return {name: value.dim() == 0 for name, value in twin.state[probe].items()}


def _check_param_state(
    entry: Any, param: torch.Tensor, layout: dict[str, bool], key: str, path: Path | str
) -> None:
    entry = _table(entry, key, path, 16)
    if sorted(entry) != sorted(layout):
        raise _refuse(path, key, sorted(entry), f"a parameter's state holds {', '.join(sorted(layout))}")
    for name, value in entry.items():
        shape = torch.Size([]) if layout[name] else param.shape
        ok = (
            isinstance(value, torch.Tensor)
            and value.dtype in ADAPTER_DTYPES
            and value.shape == shape
            and bool(torch.isfinite(value).all())
            and (not (layout[name] or name.endswith("_sq")) or bool((value >= 0).all()))
        )
        if not ok:
            raise _refuse(
                path,
                f"{key}.{name}",
                value,
                f"it must be a finite floating tensor shaped {tuple(shape)}"
                + (" and >= 0" if layout[name] or name.endswith("_sq") else ""),
            )
