"""A process's start-up imports, made with Python's cyclic garbage collector paused and then frozen.

Importing torch, accelerate, diffusers, transformers and peft creates about 600,000 objects that live
as long as the process. The collector walks them again and again while they are being created, and
once more at exit: on a 2-core CPU machine a training process's imports cost about 4.3 CPU-s with
it on and about 2.9 with it paused and the result frozen (`gc.freeze`: moved out of every later
collection, so the collections during training skip them too). A forked process shares the frozen
objects' pages instead of touching them in its first collection.

Only a process's own entry point should call this: a freeze keeps whatever is alive at that moment
forever, and a long-lived process calling it (a test runner calling `cli.main`) would keep its
garbage of the moment. The garbage the imports themselves leave (about 11,000 objects) is kept: a
collection to free it costs 0.3 CPU-s.
"""

from __future__ import annotations

import gc
import importlib
from collections.abc import Iterable

# What a process of the training stack imports before its first step.
TRAINING_STACK = ("torch", "torch.distributed", "accelerate", "diffusers", "peft")


def import_frozen(modules: Iterable[str]) -> None:
    """Import `modules` with the collector paused, then freeze every object alive (see the module
    docstring); the collector is on afterwards if it was before."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        gc.freeze()
        if enabled:
            gc.enable()
