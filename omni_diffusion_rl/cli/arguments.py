"""Argument types and output checks that several `odrl` commands share."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import MAX_SAMPLING_STEPS, MAX_STEP, ConfigError

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _json_options(text: str | None, example: str) -> object:
    """--options parsed as JSON ({} when absent), or a ConfigError showing `example`."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--options must be JSON, e.g. '{example}': {e}") from e
    except RecursionError as e:  # json nests by recursion
        raise ConfigError(f"--options nests too deeply for keyword arguments, e.g. '{example}'") from e


def _check_output_folder(path: Path, option: str = "--output") -> None:
    """Refuse, before any work, an output folder that cannot be made or written to."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is not a folder; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            f"{option} {path}: cannot write there ({e.strerror or e}); give a folder you can write to"
        ) from e


def _check_output_file(path: Path, option: str = "--output") -> None:
    """Refuse, before any work, an output file that could not be written."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give a file name")
    _check_output_folder(path.parent, f"{option} {path}: the folder")


def _top_level_parts(text: str) -> list[str]:
    """text split at the commas outside brackets and braces: `a,b@k=[x,y]` is two parts."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in _top_level_parts(text) if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names, e.g. colocated,separate")
    return names


def _guidance_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1 (1 is off), got {text!r}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 0,1,2 ({e})") from e


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from e
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0 picks a free one), got {value}")
    return value


def _positive_int(text: str, most: int = MAX_STEP) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
    return value


def _sampler_steps(text: str) -> int:
    return _positive_int(text, MAX_SAMPLING_STEPS)
