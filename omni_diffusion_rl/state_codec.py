"""Training state (optimizer, RNG states) as JSON plus a dict of tensors, never a pickle.

`encode_state` turns a tree of dicts, lists, tuples, numbers, strings, tensors and numpy arrays
into a JSON-safe tree in which every tensor is replaced by a reference to an entry of a flat
tensor dict (saved with safetensors); `decode_state` rebuilds the tree. Tuples, dicts with
non-string keys (an optimizer's state is keyed by parameter index) and numpy arrays are tagged so
they come back as they went in. Decoding accepts only these tags: a file someone edited yields
a `StateCodecError`, never code execution.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

_TENSOR, _ARRAY, _TUPLE, _DICT = "__tensor__", "__ndarray__", "__tuple__", "__dict__"
_TAGS = {_TENSOR, _ARRAY, _TUPLE, _DICT}


class StateCodecError(ValueError):
    """A state tree that cannot be encoded, or an encoded one that is malformed."""


def encode_state(tree: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """(JSON-safe tree, tensors by reference name) for `tree`."""
    tensors: dict[str, torch.Tensor] = {}

    def encode(node: Any, path: str) -> Any:
        if isinstance(node, torch.Tensor):
            tensors[path] = node.detach().cpu().contiguous()
            return {_TENSOR: path}
        if isinstance(node, np.ndarray):
            if node.dtype.kind not in "iu":
                raise StateCodecError(f"{path}: only integer numpy arrays are stored (got {node.dtype})")
            tensors[path] = torch.from_numpy(np.ascontiguousarray(node).astype(np.int64))
            return {_ARRAY: path, "dtype": node.dtype.str}
        if isinstance(node, np.generic):
            return node.item()
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        if isinstance(node, tuple):
            return {_TUPLE: [encode(v, f"{path}.{i}") for i, v in enumerate(node)]}
        if isinstance(node, list):
            return [encode(v, f"{path}.{i}") for i, v in enumerate(node)]
        if isinstance(node, dict):
            if all(isinstance(k, str) and k not in _TAGS for k in node):
                return {k: encode(v, f"{path}.{k}") for k, v in node.items()}
            for k in node:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise StateCodecError(f"{path}: dict key {k!r} is neither a string nor an integer")
            return {_DICT: [[k, encode(v, f"{path}.{k}")] for k, v in node.items()]}
        raise StateCodecError(f"{path}: cannot store a {type(node).__name__} without pickling it")

    return encode(tree, "state"), tensors


def decode_state(tree: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """The tree `encode_state` was given, from its JSON tree and tensors."""

    def tensor(name: Any) -> torch.Tensor:
        if not isinstance(name, str) or name not in tensors:
            raise StateCodecError(f"state refers to a tensor {name!r} that the tensor file does not hold")
        return tensors[name]

    def decode(node: Any) -> Any:
        if isinstance(node, list):
            return [decode(v) for v in node]
        if not isinstance(node, dict):
            return node
        tags = _TAGS.intersection(node)
        if not tags:
            return {k: decode(v) for k, v in node.items()}
        if len(tags) > 1:
            raise StateCodecError(f"malformed state entry with tags {sorted(tags)}")
        (tag,) = tags
        if tag == _TENSOR:
            return tensor(node[_TENSOR])
        if tag == _ARRAY:
            dtype = node.get("dtype")
            if not isinstance(dtype, str) or np.dtype(dtype).kind not in "iu":
                raise StateCodecError(f"malformed numpy dtype {dtype!r} in state")
            return tensor(node[_ARRAY]).numpy().astype(np.dtype(dtype))
        items = node[tag]
        if not isinstance(items, list):
            raise StateCodecError(f"malformed {tag} entry in state")
        if tag == _TUPLE:
            return tuple(decode(v) for v in items)
        if not all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], (str, int)) for p in items):
            raise StateCodecError("malformed dict entry in state")
        return {k: decode(v) for k, v in items}

    return decode(tree)
