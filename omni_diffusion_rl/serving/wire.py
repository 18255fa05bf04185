"""The reward server's wire format: a media batch as safetensors bytes, checked before any model sees it.

A request body is a safetensors file (never a pickle) holding `video` [B, F, 3, H, W] and/or `audio`
[B, C, S] as float16/bfloat16/float32, with string metadata `prompts` (a JSON list), `fps` and
`sample_rate`, and for a language model's answers `text` (a JSON list, one string per sample, each
at most MAX_TEXT_CHARS characters). The answer is JSON: `{"scores": [...], "components": {name: [...]}}`,
a non-finite score sent as null. Every dimension but the batch must be non-empty, `fps` lie in
(0, MAX_FPS] and `sample_rate` be a whole number in [1, MAX_SAMPLE_RATE]; anything else is a
WireError naming the field (a 400).
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..media import MediaBatch

CONTENT_TYPE = "application/vnd.safetensors"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEADER_BYTES = 1 << 20
MAX_FPS = 1000.0  # frames per second
MAX_SAMPLE_RATE = 1_000_000  # audio samples per second
MAX_TEXT_CHARS = 16384  # characters of one sample's text


class WireError(ValueError):
    """A request that cannot be scored: the message says what is wrong (sent back with a 4xx)."""


def encode_media(media: MediaBatch, prompts: list[str], dtype: torch.dtype = torch.float32) -> bytes:
    """Serialise a media batch and its prompts into one safetensors payload."""
    tensors = {}
    if media.video is not None:
        tensors["video"] = media.video.detach().to("cpu", dtype).contiguous()
    if media.audio is not None:
        tensors["audio"] = media.audio.detach().to("cpu", dtype).contiguous()
    metadata = {
        "prompts": json.dumps(prompts),
        "fps": repr(float(media.fps)),
        "sample_rate": str(media.sample_rate),
    }
    if media.text is not None:
        metadata["text"] = json.dumps(media.text)
    return save_tensors(tensors, metadata=metadata)


def read_metadata(body: bytes, expects: str = "'prompts', 'fps' and 'sample_rate'") -> dict[str, str]:
    """The string metadata of a safetensors payload (its JSON header), checked."""
    if len(body) < 8:
        raise WireError("the body is not a safetensors payload (shorter than its 8-byte header length)")
    (header_len,) = struct.unpack("<Q", body[:8])
    if header_len > MAX_HEADER_BYTES:
        raise WireError(f"the safetensors header is {header_len} bytes; the limit is {MAX_HEADER_BYTES}")
    if header_len > len(body) - 8:
        raise WireError(f"the safetensors header claims {header_len} bytes; the body has {len(body) - 8}")
    try:
        header = json.loads(body[8 : 8 + header_len])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise WireError(f"the safetensors header is not JSON: {e}") from e
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise WireError(f"the payload has no metadata; it must carry {expects}")
    return meta


def check_tensor(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    if t.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise WireError(f"'{name}' has dtype {str(t.dtype).removeprefix('torch.')}; send one of {allowed}")
    if t.ndim != rank:
        raise WireError(f"'{name}' must be {layout}; got shape {list(t.shape)}")
    if len(t) and 0 in t.shape[1:]:
        raise WireError(f"'{name}' must be {layout} with no empty dimension; got shape {list(t.shape)}")
    bad = ~torch.isfinite(t.flatten(1)).all(dim=1) if t.numel() else torch.zeros(0, dtype=torch.bool)
    if bad.any():
        raise WireError(f"'{name}' has NaN/inf values in samples {bad.nonzero().flatten().tolist()}")


def decode_media(body: bytes) -> tuple[MediaBatch, list[str]]:
    """The media batch and prompts in a request body, or a WireError naming what is wrong."""
    meta = read_metadata(body)
    try:
        tensors: dict[str, Any] = load_tensors(body)
    except Exception as e:  # safetensors raises its own error type for malformed payloads
        raise WireError(f"the body is not a valid safetensors payload: {e}") from e
    unknown = set(tensors) - {"video", "audio"}
    if unknown:
        raise WireError(f"unexpected tensors {sorted(unknown)}; send 'video' and/or 'audio'")
    if not tensors:
        raise WireError("the payload holds no 'video' or 'audio' tensor")
    if "video" in tensors:
        check_tensor("video", tensors["video"], 5, "[B, F, 3, H, W]")
        if tensors["video"].shape[2] != 3:
            raise WireError(
                f"'video' must have 3 colour channels in dim 2; got shape {list(tensors['video'].shape)}"
            )
    if "audio" in tensors:
        check_tensor("audio", tensors["audio"], 3, "[B, C, S]")
    sizes = {len(t) for t in tensors.values()}
    if len(sizes) != 1:
        raise WireError(f"'video' and 'audio' batch sizes differ: {sorted(sizes)}")
    batch = sizes.pop()
    if batch == 0:
        raise WireError("the batch is empty (0 samples)")
    prompts = read_prompts(meta, batch, "samples")
    fps = _rate(meta, "fps", lambda v: 0 < v <= MAX_FPS, f"a number in (0, {MAX_FPS:g}]")
    sample_rate = _rate(
        meta,
        "sample_rate",
        lambda v: v.is_integer() and 1 <= v <= MAX_SAMPLE_RATE,
        f"a whole number of samples per second in [1, {MAX_SAMPLE_RATE}]",
    )
    text = None if "text" not in meta else read_prompts(meta, batch, "samples", key="text")
    if text is not None and any(len(t) > MAX_TEXT_CHARS for t in text):
        raise WireError(f"metadata 'text': a sample's text is longer than {MAX_TEXT_CHARS} characters")
    media = MediaBatch(
        video=tensors["video"].float() if "video" in tensors else None,
        audio=tensors["audio"].float() if "audio" in tensors else None,
        fps=fps,
        sample_rate=int(sample_rate),
        text=text,
    )
    return media, prompts


def read_prompts(meta: dict[str, str], batch: int, what: str, key: str = "prompts") -> list[str]:
    """Metadata `key`: a JSON list of exactly `batch` strings, or a WireError saying so."""
    try:
        prompts = json.loads(meta.get(key, ""))
    except (TypeError, json.JSONDecodeError) as e:
        raise WireError(f"metadata '{key}' is not JSON ({e}); send a JSON list of strings") from e
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError(f"metadata '{key}' must be a JSON list of strings")
    if len(prompts) != batch:
        raise WireError(f"{len(prompts)} {key} for a batch of {batch} {what}")
    return prompts


def _rate(meta: dict[str, str], key: str, valid: Callable[[float], bool], expected: str) -> float:
    """The number in metadata `key` when it is finite and `valid`, else a WireError naming `key`."""
    text = meta.get(key)
    if not isinstance(text, str):
        raise WireError(
            f"the payload's metadata has no '{key}'; it must carry 'prompts', 'fps' and 'sample_rate'"
        )
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and valid(value)):
        raise WireError(f"metadata '{key}' is {text[:50]!r}; it must be {expected}")
    return value


def scores_to_json(values: torch.Tensor) -> list[float | None]:
    """Scores as JSON numbers, NaN/inf as null (JSON has no NaN)."""
    return [float(v) if math.isfinite(v) else None for v in values.double().tolist()]


def scores_from_json(values: object, batch: int, what: str) -> torch.Tensor:
    """A JSON list of numbers/nulls as a float tensor [batch], null as NaN."""
    if not isinstance(values, list) or len(values) != batch:
        raise ValueError(f"{what}: expected a list of {batch} scores; got {str(values)[:200]}")
    if not all(v is None or isinstance(v, (int, float)) for v in values):
        raise ValueError(f"{what}: scores must be numbers or null; got {str(values)[:200]}")
    return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)
