"""JSON from outside the process (checkpoints, question files, servers' answers) read within bounds.

The nesting is measured in one pass without recursion before anything is parsed, so no text reaches
Python's recursion limit; `loads_bounded` also refuses NaN and Infinity, which Python's json reads
but JSON itself does not allow."""

from __future__ import annotations

import json
import re
from typing import Any

_TOKEN = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.DOTALL)
"""A JSON string (skipped whole, brackets in it included) or a bracket."""


def nesting_depth(text: str, stop_above: int | None = None) -> int:
    """How deep `text` nests lists and objects (brackets inside strings do not count); the count
    stops at the first level above `stop_above` when given."""
    depth = deepest = 0
    for match in _TOKEN.finditer(text):
        first = match.group()[0]
        if first in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if stop_above is not None and depth > stop_above:
                return deepest
        elif first in "]}":
            depth -= 1
    return deepest


def nesting_exceeds(text: str, limit: int) -> bool:
    """Whether `text` nests lists and objects more than `limit` deep."""
    return nesting_depth(text, stop_above=limit) > limit


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def loads_bounded(text: str | bytes, max_depth: int, what: str) -> Any:
    """`text` parsed as strict JSON, nested at most `max_depth` deep; a ValueError naming `what`
    otherwise (not UTF-8, not JSON, too deep, or NaN/Infinity)."""
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if nesting_exceeds(text, max_depth):
        raise ValueError(f"{what} nests lists and objects more than {max_depth} deep")
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError as e:  # JSONDecodeError, NaN/Infinity, or an integer too long to convert
        raise ValueError(f"{what} is not valid JSON ({str(e)[:200]})") from None
