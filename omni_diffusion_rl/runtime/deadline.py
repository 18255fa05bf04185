"""Python code from outside the project (a model folder's chat template, compiled by Jinja to Python)
run under a time bound: a trace function checks the clock every few thousand lines and stops the call
with DeadlineExceeded. It bounds Python-level loops only (a single native call is not interrupted),
and only on the calling thread."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

T = TypeVar("T")
CHECK_EVERY = 4096  # trace events between clock reads


class DeadlineExceeded(RuntimeError):
    """A call bounded by `call_with_deadline` ran past its seconds."""


def call_with_deadline(call: Callable[[], T], seconds: float, what: str) -> T:
    """`call()`, stopped with DeadlineExceeded (naming `what`) once it has run `seconds`."""
    deadline = time.monotonic() + seconds
    events = 0

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal events
        events += 1
        if events % CHECK_EVERY == 0 and time.monotonic() > deadline:
            raise DeadlineExceeded(f"{what} ran over {seconds:g} s and was stopped")
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        return call()
    finally:
        sys.settrace(previous)
