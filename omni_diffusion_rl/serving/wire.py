"""The reward server's wire format: a media batch as safetensors bytes, checked before any model sees it.

A request body is a safetensors file (never a pickle) holding `video` [B, F, 3, H, W] and/or `audio`
[B, C, S] as float16/bfloat16/float32, with string metadata `prompts` (a JSON list, each prompt at
most MAX_PROMPT_CHARS characters), `fps` and `sample_rate`, and for a language model's answers
`text` (a JSON list, one string per sample, each at most MAX_TEXT_CHARS characters). The answer is
JSON: `{"scores": [...], "components": {name: [...]}}`, a non-finite score sent as null. Every
dimension but the batch must be non-empty, `fps` lie in (0, MAX_FPS] and `sample_rate` be a whole
number in [1, MAX_SAMPLE_RATE]; anything else is a WireError naming the field (a 400).

Everything but the tensors' values is known from the header (the body's first 8 + header-length
bytes), so the server checks a request's header before receiving the rest of its body:
`check_media_header` refuses, besides malformed requests, more samples than the server's max batch
and media beyond what the reward is meant for (`omni_diffusion_rl.reward.InputLimits`) with a
TooLarge (a 413) naming the limit and the value received.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ..media import MediaBatch
from ..reward import InputLimits

CONTENT_TYPE = "application/vnd.safetensors"
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIRE_DTYPES = {"F16": 2, "BF16": 2, "F32": 4}  # safetensors' names of FLOAT_DTYPES, with bytes per value
DTYPE_WORDS = {  # safetensors' dtype names in torch's words, for messages
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}
MAX_HEADER_BYTES = 1 << 20
MAX_FPS = 1000.0  # frames per second
MAX_SAMPLE_RATE = 1_000_000  # audio samples per second
MAX_PROMPT_CHARS = 16384  # characters of one prompt (reward and teacher servers)
MAX_TEXT_CHARS = 16384  # characters of one sample's text
VIDEO_LAYOUT, AUDIO_LAYOUT = "[B, F, 3, H, W]", "[B, C, S]"
MEDIA_EXPECTS = "'prompts', 'fps' and 'sample_rate'"


class WireError(ValueError):
    """A request that cannot be scored: the message says what is wrong (sent back with `status`)."""

    status = 400


class TooLarge(WireError):
    """A request beyond a limit of the server or of the reward it asks for (a 413)."""

    status = 413


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as a safetensors header declares it."""

    dtype: str
    shape: tuple[int, ...]
    offsets: tuple[int, int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Header:
    """A safetensors header: its tensors, its string metadata and the bytes it takes (8 + JSON)."""

    tensors: dict[str, TensorSpec]
    metadata: dict[str, str]
    size: int

    @property
    def payload_bytes(self) -> int:
        """The whole payload's length as the header declares it: 8 + header, then the tensor data
        up to the furthest end offset (safetensors allows nothing after it)."""
        return self.size + max((spec.offsets[1] for spec in self.tensors.values()), default=0)


@dataclass(frozen=True)
class MediaMeta:
    """What a media request's header says besides its tensors."""

    batch: int
    prompts: list[str]
    fps: float
    sample_rate: int
    text: list[str] | None


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


# ------------------------------------------------------------------------------------------ the header
def header_length(prefix: bytes, body_length: int | None) -> int:
    """The JSON header's length from a body's first 8 bytes, checked against MAX_HEADER_BYTES and
    against `body_length` (the whole body's, when known)."""
    if len(prefix) < 8:
        raise WireError("the body is not a safetensors payload (shorter than its 8-byte header length)")
    (size,) = struct.unpack("<Q", prefix[:8])
    if size > MAX_HEADER_BYTES:
        raise WireError(f"the safetensors header is {size} bytes; the limit is {MAX_HEADER_BYTES}")
    if body_length is not None and size > body_length - 8:
        raise WireError(f"the safetensors header claims {size} bytes; the body has {body_length - 8}")
    return size


def _json(text: str | bytes, what: str) -> Any:
    """`text` parsed as JSON, or a WireError saying `what` is not JSON (bad syntax or encoding, a
    number too long to convert, or nesting too deep to parse)."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise WireError(f"{what} is not JSON ({type(e).__name__}: {str(e)[:200]})") from e


def _metadata(header: Any, expects: str) -> dict[str, str]:
    meta = header.get("__metadata__") if isinstance(header, dict) else None
    if not isinstance(meta, dict):
        raise WireError(f"the payload has no metadata; it must carry {expects}")
    if not all(isinstance(v, str) for v in meta.values()):
        raise WireError("the payload's metadata values must all be strings (safetensors metadata)")
    return meta


def read_metadata(body: bytes, expects: str = MEDIA_EXPECTS) -> dict[str, str]:
    """The string metadata of a safetensors payload (its JSON header), checked."""
    size = header_length(body, len(body))
    return _metadata(_json(body[8 : 8 + size], "the safetensors header"), expects)


def read_header(body: bytes, expects: str = MEDIA_EXPECTS) -> Header:
    """The header of a safetensors payload: `body` may be the whole payload or only its first
    8 + header-length bytes. A WireError says what is malformed."""
    size = header_length(body, len(body))
    parsed = _json(body[8 : 8 + size], "the safetensors header")
    meta = _metadata(parsed, expects)
    tensors = {name: _spec(name, entry) for name, entry in parsed.items() if name != "__metadata__"}
    return Header(tensors, meta, 8 + size)


def _spec(name: str, entry: Any) -> TensorSpec:
    """A header entry as a TensorSpec, or a WireError showing the form it must have."""
    if isinstance(entry, dict):
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if (
            isinstance(dtype, str)
            and _naturals(shape)
            and _naturals(offsets)
            and len(offsets) == 2
            and offsets[0] <= offsets[1]
        ):
            return TensorSpec(dtype, tuple(shape), (offsets[0], offsets[1]))
    raise WireError(
        f"the safetensors header's entry for {name[:100]!r} is not "
        "{'dtype': str, 'shape': [int, ...], 'data_offsets': [begin, end]}"
    )


def _naturals(values: Any) -> bool:
    """A list of whole numbers >= 0 (JSON true/false are not numbers here)."""
    return isinstance(values, list) and all(type(v) is int and v >= 0 for v in values)


def _shape_text(shape: tuple[int, ...]) -> str:
    text = str(list(shape))
    return text if len(text) <= 120 else text[:117] + "..."


def check_spec(name: str, spec: TensorSpec, rank: int, layout: str) -> None:
    """A declared tensor's dtype and shape: a float dtype, `rank` dimensions, none empty but the batch."""
    if spec.dtype not in WIRE_DTYPES:
        allowed = ", ".join(DTYPE_WORDS[d] for d in WIRE_DTYPES)
        given = DTYPE_WORDS.get(spec.dtype, spec.dtype[:40])
        raise WireError(f"'{name}' has dtype {given}; send one of {allowed}")
    if len(spec.shape) != rank:
        raise WireError(f"'{name}' must be {layout}; got shape {_shape_text(spec.shape)}")
    if spec.shape[0] and 0 in spec.shape[1:]:
        got = _shape_text(spec.shape)
        raise WireError(f"'{name}' must be {layout} with no empty dimension; got shape {got}")


def check_media_header(
    header: Header,
    limits: InputLimits | None = None,
    max_batch: int | None = None,
    reward: str = "this reward",
) -> MediaMeta:
    """Everything a media request's header says, checked: its tensors' names, dtypes and shapes, the
    batch against `max_batch`, the media against the reward's `limits`, prompts, rates and text."""
    specs = header.tensors
    unknown = set(specs) - {"video", "audio"}
    if unknown:
        names = sorted(n[:40] for n in unknown)[:5]
        raise WireError(f"unexpected tensors {names}; send 'video' and/or 'audio'")
    if not specs:
        raise WireError("the payload holds no 'video' or 'audio' tensor")
    if "video" in specs:
        check_spec("video", specs["video"], 5, VIDEO_LAYOUT)
        if specs["video"].shape[2] != 3:
            got = _shape_text(specs["video"].shape)
            raise WireError(f"'video' must have 3 colour channels in dim 2; got shape {got}")
    if "audio" in specs:
        check_spec("audio", specs["audio"], 3, AUDIO_LAYOUT)
    sizes = {s.shape[0] for s in specs.values()}
    if len(sizes) != 1:
        raise WireError(f"'video' and 'audio' batch sizes differ: {sorted(sizes)}")
    batch = sizes.pop()
    if batch == 0:
        raise WireError("the batch is empty (0 samples)")
    if max_batch is not None and batch > max_batch:
        raise TooLarge(f"{batch} samples exceed the server's max batch of {max_batch}; send fewer")
    if limits is not None:
        check_limits(specs, limits, max_batch or batch, reward)
    meta = header.metadata
    prompts = read_prompts(meta, batch, "samples")
    fps = _rate(meta, "fps", lambda v: 0 < v <= MAX_FPS, f"a number in (0, {MAX_FPS:g}]")
    sample_rate = _rate(
        meta,
        "sample_rate",
        lambda v: v.is_integer() and 1 <= v <= MAX_SAMPLE_RATE,
        f"a whole number of samples per second in [1, {MAX_SAMPLE_RATE}]",
    )
    text = None
    if "text" in meta:
        text = read_prompts(meta, batch, "samples", key="text", max_chars=MAX_TEXT_CHARS)
    return MediaMeta(batch, prompts, fps, int(sample_rate), text)


def check_limits(specs: dict[str, TensorSpec], limits: InputLimits, max_batch: int, reward: str) -> None:
    """A TooLarge when the media exceed what `reward` is meant for: frames larger than its frame size,
    or more video pixels or audio values than `max_batch` of its largest samples."""
    meant = f" ({limits.meant_for})" if limits.meant_for else ""
    if "video" in specs:
        b, f, _, h, w = specs["video"].shape
        if h > limits.frame_height or w > limits.frame_width:
            raise TooLarge(
                f"'video' frames are {h} x {w} pixels (H x W); reward '{reward}' takes frames of at "
                f"most {limits.frame_height} x {limits.frame_width}{meant}. Send smaller frames, or "
                "score these with a reward meant for them"
            )
        pixels, budget = b * f * h * w, max_batch * limits.pixels
        if pixels > budget:
            raise TooLarge(
                f"'video' holds {pixels} pixels ({b} samples x {f} frames of {h} x {w}); reward "
                f"'{reward}' takes at most {budget} per request (max batch {max_batch} x {limits.frames} "
                f"frames of {limits.frame_height} x {limits.frame_width}){meant}. Send fewer or shorter clips"
            )
    if "audio" in specs:
        b, c, s = specs["audio"].shape
        values, budget = b * c * s, max_batch * limits.audio_samples
        if values > budget:
            raise TooLarge(
                f"'audio' holds {values} values ({b} samples x {c} channels x {s}); reward '{reward}' "
                f"takes at most {budget} per request (max batch {max_batch} x {limits.audio_samples})"
                f"{meant}. Send fewer or shorter clips"
            )


# ------------------------------------------------------------------------------------------ the tensors
def load_checked(body: bytes, header: Header) -> dict[str, torch.Tensor]:
    """The tensors of a payload whose header is `header`: their byte ranges must tile the data after
    the header exactly and match their dtypes and shapes (checked here, before safetensors reads)."""
    data = len(body) - header.size
    end = 0
    for name, spec in sorted(header.tensors.items(), key=lambda item: item[1].offsets):
        begin, stop = spec.offsets
        expected = spec.numel * WIRE_DTYPES.get(spec.dtype, 1)
        if begin != end or stop - begin != expected:
            raise WireError(
                f"'{name[:40]}' takes bytes {begin}-{stop} after the header; its dtype and shape need "
                f"{expected} bytes from {end} (tensors must follow each other)"
            )
        end = stop
    if end != data:
        raise WireError(f"the tensors take {end} bytes after the header; the body has {data}")
    try:
        tensors: dict[str, torch.Tensor] = load_tensors(body)
    except Exception as e:  # safetensors raises its own error type for malformed payloads
        raise WireError(f"the body is not a valid safetensors payload: {str(e)[:300]}") from e
    if {k: tuple(t.shape) for k, t in tensors.items()} != {k: s.shape for k, s in header.tensors.items()}:
        raise WireError("the safetensors header describes its tensors twice, differently")
    return tensors


def check_finite(name: str, t: torch.Tensor) -> None:
    """A WireError naming the samples (rows) of `t` that hold NaN or inf."""
    if not t.numel():
        return
    bad = ~torch.isfinite(t.flatten(1)).all(dim=1)
    if bad.any():
        rows = bad.nonzero().flatten().tolist()
        shown = f"{rows[:20]}" if len(rows) <= 20 else f"{rows[:20]} and {len(rows) - 20} more"
        raise WireError(f"'{name}' has NaN/inf values in samples {shown}")


def check_tensor(name: str, t: torch.Tensor, rank: int, layout: str) -> None:
    """A received tensor's dtype, rank, non-empty dimensions and finite values."""
    if t.dtype not in FLOAT_DTYPES:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise WireError(f"'{name}' has dtype {str(t.dtype).removeprefix('torch.')}; send one of {allowed}")
    if t.ndim != rank:
        raise WireError(f"'{name}' must be {layout}; got shape {list(t.shape)}")
    if len(t) and 0 in t.shape[1:]:
        raise WireError(f"'{name}' must be {layout} with no empty dimension; got shape {list(t.shape)}")
    check_finite(name, t)


def decode_media(
    body: bytes,
    limits: InputLimits | None = None,
    max_batch: int | None = None,
    reward: str = "this reward",
) -> tuple[MediaBatch, list[str]]:
    """The media batch and prompts in a request body, or a WireError naming what is wrong (a
    TooLarge beyond `max_batch` samples or the reward's `limits`). Allocates at most about twice
    the body's size (half-precision values become float32)."""
    header = read_header(body)
    meta = check_media_header(header, limits, max_batch, reward)
    tensors = load_checked(body, header)
    for name, t in tensors.items():
        check_finite(name, t)
    media = MediaBatch(
        video=tensors["video"].float() if "video" in tensors else None,
        audio=tensors["audio"].float() if "audio" in tensors else None,
        fps=meta.fps,
        sample_rate=meta.sample_rate,
        text=meta.text,
    )
    return media, meta.prompts


def read_prompts(
    meta: dict[str, str], batch: int, what: str, key: str = "prompts", max_chars: int = MAX_PROMPT_CHARS
) -> list[str]:
    """Metadata `key`: a JSON list of exactly `batch` strings of at most `max_chars` characters each,
    or a WireError saying so."""
    raw = meta.get(key)
    if not isinstance(raw, str):
        raise WireError(f"metadata '{key}' is missing; send a JSON list of strings")
    try:
        prompts = _json(raw, f"metadata '{key}'")
    except WireError as e:
        raise WireError(f"{e}; send a JSON list of strings") from e
    if not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise WireError(f"metadata '{key}' must be a JSON list of strings")
    if len(prompts) != batch:
        raise WireError(f"{len(prompts)} {key} for a batch of {batch} {what}")
    longest = max(range(batch), key=lambda i: len(prompts[i]), default=None)
    if longest is not None and len(prompts[longest]) > max_chars:
        raise WireError(
            f"metadata '{key}': sample {longest}'s {key.removesuffix('s')} is {len(prompts[longest])} "
            f"characters, longer than the limit of {max_chars}; shorten it"
        )
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
