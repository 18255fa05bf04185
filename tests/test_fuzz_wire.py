"""Fuzzing the wire decoders of both servers (hypothesis, bounded in examples, not time).

`decode_media` (reward server) and `decode_states` (teacher server), and the header checks each
server runs before it receives a body, get arbitrary bytes, valid bodies with mutations, and bodies
whose JSON header is built field by field from hostile values. Each must either decode or raise
WireError: any other exception would be a 500 and a traceback in the server's log. What a decoder
accepts must keep the wire's promises (the oracle `_check_media` / `_check_states`): the header within
MAX_HEADER_BYTES, prompts and text within their limits, finite float32 tensors of the right rank, the
rates in range, and at most twice the body's bytes decoded (so memory is bounded by the request size).

Each fuzz test's docstring names the mutations of the decoders it was shown to catch: the check was
removed (or loosened) in a copy of the package, this file run there, and the test failed (the copy
then thrown away). The fuzz tests are seeded, so each run tries the same bodies and a mutant is
caught on every run, not by luck. The mutations are entries of tests/tools/mutations.py: re-run with
`python -m tests.tools.mutations --only 'wire-*'` (`--list` shows which test claims which). It found
the media bodies differ between runs (safetensors writes their metadata in a Rust HashMap's order,
new in each process): its entry wire-no-frame-size-mutated-bodies survived 1 run of 14 (flaky).
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st
from safetensors.torch import save as save_tensors

from omni_diffusion_rl.reward import InputLimits
from omni_diffusion_rl.serving.teacher_wire import check_states_header, decode_states, encode_states
from omni_diffusion_rl.serving.wire import (
    MAX_FPS,
    MAX_HEADER_BYTES,
    MAX_PROMPT_CHARS,
    MAX_SAMPLE_RATE,
    MAX_TEXT_CHARS,
    TooLarge,
    WireError,
    check_media_header,
    decode_media,
    read_header,
)

# Bounded in examples, not time; seeded (`@seed(SEED)` on each test): every run, CI's or a mutant's,
# tries the same bodies, whatever else changes in this file.
FUZZ = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
SEED = 24
LATENT = (6,)
LIMITS = InputLimits(frames=3, frame_height=4, frame_width=4, audio_samples=12, meant_for="fuzz clips")
MAX_BATCH = 3
MEDIA_META = ["prompts", "fps", "sample_rate", "text"]
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
WIRE_NAMES = ["F16", "BF16", "F32", "F64", "I32", "U8", "BOOL", "F8_E4M3", "X", ""]


# ------------------------------------------------------------------------------------------ oracles
def _header_bytes(body: bytes) -> int:
    return struct.unpack("<Q", body[:8])[0]


def _check_media(body: bytes, media: Any, prompts: list[str], limits: InputLimits | None = None) -> None:
    """What decode_media promises about what it accepts."""
    assert _header_bytes(body) <= MAX_HEADER_BYTES
    batch = len(media)
    assert batch >= 1 and len(prompts) == batch
    assert all(isinstance(p, str) and len(p) <= MAX_PROMPT_CHARS for p in prompts)
    if media.text is not None:
        assert len(media.text) == batch and all(len(t) <= MAX_TEXT_CHARS for t in media.text)
    assert 0 < media.fps <= MAX_FPS and 1 <= media.sample_rate <= MAX_SAMPLE_RATE
    assert isinstance(media.sample_rate, int)
    decoded = 0
    for t, rank in ((media.video, 5), (media.audio, 3)):
        if t is None:
            continue
        assert t.dtype == torch.float32 and t.ndim == rank and len(t) == batch
        assert 0 not in t.shape and bool(torch.isfinite(t).all())
        decoded += t.numel() * 4
    assert media.video is not None or media.audio is not None
    if media.video is not None:
        assert media.video.shape[2] == 3
    assert decoded <= 2 * len(body), "decoding must allocate at most twice the body"
    if limits is not None:
        assert batch <= MAX_BATCH
        if media.video is not None:
            b, f, _, h, w = media.video.shape
            assert h <= limits.frame_height and w <= limits.frame_width
            assert b * f * h * w <= MAX_BATCH * limits.pixels
        if media.audio is not None:
            assert media.audio.numel() <= MAX_BATCH * limits.audio_samples


def _check_states(body: bytes, states: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> None:
    """What decode_states promises about what it accepts."""
    assert _header_bytes(body) <= MAX_HEADER_BYTES
    assert 1 <= len(states) <= MAX_BATCH and tuple(states.shape[1:]) == LATENT
    assert t.shape == (len(states),) and len(prompts) == len(states)
    assert all(len(p) <= MAX_PROMPT_CHARS for p in prompts)
    assert states.dtype == t.dtype == torch.float32
    assert bool(torch.isfinite(states).all()) and bool(((t >= 0) & (t <= 1)).all())
    assert (states.numel() + t.numel()) * 4 <= 2 * len(body)


def _decode_media_or_wire_error(body: bytes, limits: InputLimits | None = None) -> None:
    """decode_media (and the header check a server runs first) decodes or raises WireError only."""
    try:
        if limits is not None:
            check_media_header(read_header(body[: 8 + _prefix_length(body)]), limits, MAX_BATCH, "fuzz")
        media, prompts = decode_media(body, limits, MAX_BATCH if limits else None, "fuzz")
    except WireError as e:
        event(f"refused ({type(e).__name__})")
        return
    event("decoded")
    _check_media(body, media, prompts, limits)


def _decode_states_or_wire_error(body: bytes) -> None:
    try:
        check_states_header(read_header(body[: 8 + _prefix_length(body)]), LATENT, MAX_BATCH)
        states, t, prompts = decode_states(body, LATENT, MAX_BATCH)
    except WireError as e:
        event(f"refused ({type(e).__name__})")
        return
    event("decoded")
    _check_states(body, states, t, prompts)


def _prefix_length(body: bytes) -> int:
    """The header length a body claims (what a server reads before the rest), capped to the body."""
    return min(_header_bytes(body), len(body)) if len(body) >= 8 else 0


# ------------------------------------------------------------------------------------------ strategies
_special = st.sampled_from([0.0, -1.0, 0.5, 1.0, 2.0, 65504.0, 1e-8, math.nan, math.inf, -math.inf])


@st.composite
def _tensor(draw: st.DrawFn, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of `shape` in a float dtype: one value everywhere but a few places (NaN, inf, ...)."""
    values = torch.full((math.prod(shape),), draw(st.floats(-2, 2) | _special), dtype=torch.float32)
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 3])) if len(values) else 0):
        values[draw(st.integers(0, len(values) - 1))] = draw(_special)
    return values.reshape(shape).to(draw(st.sampled_from(DTYPES)))


_dims = st.sampled_from([1, 2, 3, 1, 0])  # 0: an empty dimension
_side = st.sampled_from([1, 4, 5, 2, 0])  # a frame's height or width: over LIMITS at 5
_batch = st.sampled_from([1, 2, MAX_BATCH, 1, 0, MAX_BATCH + 1])
_long = st.integers(MAX_PROMPT_CHARS - 1, MAX_PROMPT_CHARS + 1).map(lambda n: "p" * n)
_prompt = st.text(max_size=20) | st.text(max_size=20) | st.text(max_size=20) | _long
VALID_RATES, BAD_RATES = (
    ["8.0", "1", "1000", "1000000"],
    ["0", "-1", "nan", "inf", "1e30", "16000.5", "x", ""],
)
_rate = st.sampled_from(VALID_RATES * 6 + BAD_RATES)


@st.composite
def media_bodies(draw: st.DrawFn) -> bytes:
    """Valid-looking media requests: small video/audio of any float dtype (NaN and inf included),
    sizes around the fuzz limits, prompts around MAX_PROMPT_CHARS, rates valid or not."""
    batch = draw(_batch)
    tensors = {}
    if draw(st.booleans()):
        channels = draw(st.sampled_from([3, 3, 3, 3, 1]))
        tensors["video"] = draw(_tensor((batch, draw(_dims), channels, draw(_side), draw(_side))))
    if draw(st.booleans()) or not tensors:
        tensors["audio"] = draw(_tensor((batch, draw(_dims), draw(_dims))))
    count = draw(st.sampled_from([batch, batch, batch, batch, batch + 1]))
    prompts = draw(st.lists(_prompt, min_size=count, max_size=count))
    meta = {"prompts": json.dumps(prompts), "fps": draw(_rate), "sample_rate": draw(_rate)}
    if draw(st.booleans()):
        meta["text"] = json.dumps(draw(st.lists(st.text(max_size=8), min_size=batch, max_size=batch)))
    return save_tensors(tensors, metadata=meta)


@st.composite
def sized_media_bodies(draw: st.DrawFn) -> bytes:
    """Well-formed media requests whose sizes vary around the fuzz limits: up to MAX_BATCH + 1
    samples of up to 5 frames of up to 6 x 6 pixels, up to 2 channels of up to 40 audio values."""
    batch = draw(st.integers(1, MAX_BATCH + 1))
    shape = (batch, draw(st.integers(1, 5)), 3, draw(st.integers(1, 6)), draw(st.integers(1, 6)))
    tensors = {
        "video": torch.zeros(shape),
        "audio": torch.zeros(batch, draw(st.integers(1, 2)), draw(st.integers(1, 40))),
    }
    if draw(st.booleans()):
        del tensors[draw(st.sampled_from(["video", "audio"]))]
    meta = {"prompts": json.dumps(["p"] * batch), "fps": "8", "sample_rate": "8000"}
    return save_tensors(tensors, metadata=meta)


@st.composite
def states_bodies(draw: st.DrawFn) -> bytes:
    """Valid-looking teacher requests: states of the latent shape or near it, t in or out of [0, 1]."""
    batch = draw(_batch)
    latent = draw(st.sampled_from([LATENT, LATENT, LATENT, (5,), (6, 1)]))
    states = draw(_tensor((batch, *latent)))
    t = draw(_tensor((draw(st.sampled_from([batch, batch, batch, batch + 1])),))).clamp(-0.5, 1.5)
    prompts = draw(st.lists(_prompt, min_size=batch, max_size=batch))
    if draw(st.booleans()):
        return encode_states(states, t, prompts)
    return save_tensors({"states": states, "t": t}, metadata={"prompts": json.dumps(prompts)})


@st.composite
def mutated(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> bytes:
    """A body with a few mutations: flipped, overwritten, inserted or cut bytes, or a new header length."""
    body = bytearray(draw(bodies))
    for _ in range(draw(st.sampled_from([0, 1, 1, 2, 4]))):
        kind = draw(st.sampled_from(["flip", "write", "insert", "cut", "length", "pad"]))
        at = draw(st.integers(0, max(0, len(body) - 1)))
        if kind == "flip" and body:
            body[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "write":
            body[at : at + 4] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "cut":
            del body[at:]
        elif kind == "length":
            size = draw(st.sampled_from([0, 1, len(body) - 8, len(body), MAX_HEADER_BYTES + 1, 2**64 - 1]))
            body[:8] = struct.pack("<Q", max(0, size) % 2**64)
        else:
            body = bytearray(draw(padded(st.just(bytes(body)))))
    return bytes(body)


@st.composite
def padded(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> bytes:
    """A body whose JSON header is grown with spaces (valid JSON still) by 8 bytes, to exactly
    MAX_HEADER_BYTES, or to one byte more."""
    body = draw(bodies)
    if len(body) < 8 or _header_bytes(body) > MAX_HEADER_BYTES:
        return body
    size = _header_bytes(body)
    grown = max(size, draw(st.sampled_from([size + 8, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1])))
    end = 8 + size
    return struct.pack("<Q", grown) + body[8:end] + b" " * (grown - size) + body[end:]


_json_leaf = (
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=10)
    | st.sampled_from(WIRE_NAMES)
)
_json_value = st.recursive(
    _json_leaf,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
_json_bomb = st.sampled_from(
    [
        "[" * 100_000 + "]" * 100_000,  # nesting deeper than the parser's recursion limit
        "[" + "1" * 5000 + "]",  # an integer longer than Python converts
    ]
)
_hostile_text = _json_bomb | st.sampled_from(
    [
        '["a", "b"]',
        '"not a list"',
        "[1, 2]",
        "{",
        "",
        json.dumps(["p" * (MAX_PROMPT_CHARS + 1)]),
        "NaN",
    ]
)


CANONICAL = {
    "video": ("F32", [1, 1, 3, 2, 2]),
    "audio": ("F16", [1, 1, 4]),
    "states": ("F32", [1, 6]),
    "t": ("F16", [1]),
}
_hostile_number = st.sampled_from([0, -1, 2**40, 2**63, 2**70, "3", 1.5, True, None, [1]])
_sometimes = st.sampled_from([False] * 5 + [True])  # now and then


@st.composite
def _entry(draw: st.DrawFn, name: str, begin: int) -> tuple[Any, int]:
    """A header entry for tensor `name` starting at byte `begin`, and where its data ends: the
    tensor's usual dtype and shape at offsets where they belong, half the time with one part hostile."""
    dtype, shape = CANONICAL.get(name, ("F32", [1]))
    shape = list(shape)
    broken = draw(st.sampled_from([None] * 6 + ["entry", "dtype", "dim", "rank", "offset", "field"]))
    if broken == "entry":
        return draw(_json_value), begin
    if broken == "dtype":
        dtype = draw(st.sampled_from(WIRE_NAMES))
    elif broken == "dim":
        shape[draw(st.integers(0, len(shape) - 1))] = draw(_hostile_number)
    elif broken == "rank":
        shape = shape[: draw(st.integers(0, len(shape)))] + draw(st.lists(st.integers(0, 3), max_size=2))
    numel = math.prod(d for d in shape if type(d) is int and 0 <= d < 2**20)
    offsets: list[Any] = [begin, begin + numel * {"F32": 4}.get(dtype, 2)]
    if broken == "offset":
        offsets[draw(st.integers(0, 1))] = draw(_hostile_number)
    entry = {"dtype": dtype, "shape": shape, "data_offsets": offsets}
    if broken == "field":
        entry[draw(st.sampled_from(["dtype", "shape", "data_offsets"]))] = draw(_json_value)
    return entry, offsets[1] if type(offsets[1]) is int and 0 <= offsets[1] < 2**16 else begin


@st.composite
def built_headers(draw: st.DrawFn, names: list[str], meta_keys: list[str]) -> bytes:
    """A body whose JSON header is built from hostile parts: entries for `names` (sometimes others
    or fewer), metadata with hostile strings or non-strings, padding up to past MAX_HEADER_BYTES,
    and data as long as the entries say (give or take)."""
    header: dict[str, Any] = {}
    chosen = names if not draw(_sometimes) else draw(st.lists(st.sampled_from([*names, "x"]), max_size=3))
    end = 0
    for name in chosen:
        header[name], end = draw(_entry(name, end))
    meta = {key: draw(_rate) if key in ("fps", "sample_rate") else '["p"]' for key in meta_keys}
    for key in draw(st.lists(st.sampled_from(meta_keys), max_size=2)):
        meta[key] = draw(st.one_of(_hostile_text, _hostile_text, st.text(max_size=12), _rate))
    if draw(_sometimes):  # a JSON bomb where a list of strings is parsed
        meta[draw(st.sampled_from([k for k in meta_keys if k in ("prompts", "text")]))] = draw(_json_bomb)
    broken = draw(st.sampled_from([None] * 8 + ["value", "metadata"]))
    if broken == "value":
        meta[draw(st.sampled_from(meta_keys))] = draw(_json_value)
    header["__metadata__"] = draw(_json_value) if broken == "metadata" else meta
    text = json.dumps(header)  # NaN and Infinity written as such: Python reads them, safetensors does not
    padding = draw(
        st.sampled_from([0] * 8 + [7, MAX_HEADER_BYTES - len(text), MAX_HEADER_BYTES - len(text) + 1])
    )
    raw = (text + " " * max(0, padding)).encode()
    data = b"\0" * max(0, end + draw(st.sampled_from([0, 0, 0, -1, 3])))
    return struct.pack("<Q", len(raw)) + raw + data


# ------------------------------------------------------------------------------------------ reward server
@FUZZ
@seed(SEED)
@given(st.binary(max_size=200) | st.binary(min_size=8, max_size=64).map(lambda b: b[:8] + b"{" + b[8:]))
def test_decode_media_on_arbitrary_bytes_decodes_or_raises_wire_error(body: bytes) -> None:
    """Arbitrary bytes. Caught mutation: the short-body check in `header_length` removed (a body
    under 8 bytes raised struct.error, a 500)."""
    _decode_media_or_wire_error(body)


@FUZZ
@seed(SEED)
@given(mutated(media_bodies()), st.booleans())
def test_decode_media_on_mutated_bodies_decodes_or_raises_wire_error(body: bytes, limited: bool) -> None:
    """Valid-looking bodies, mutated. Caught mutations: the NaN/inf check (`check_finite`) removed from
    decode_media (NaN samples were accepted); the prompt length check in `read_prompts` removed (a
    prompt of MAX_PROMPT_CHARS + 1 characters was accepted); the frame size check in `check_limits`
    removed; `_json` catching only JSONDecodeError (a flipped byte made the header invalid UTF-8:
    UnicodeDecodeError)."""
    _decode_media_or_wire_error(body, LIMITS if limited else None)


@FUZZ
@seed(SEED)
@given(sized_media_bodies() | media_bodies())
def test_decode_media_keeps_the_reward_limits(body: bytes) -> None:
    """Bodies of every size around a reward's limits and max batch. Caught mutations: the frame size
    check in `check_limits` removed (5 x 5 frames were accepted for a reward meant for 4 x 4); the
    NaN/inf check removed."""
    _decode_media_or_wire_error(body, LIMITS)


@FUZZ
@seed(SEED)
@given(built_headers(["video", "audio"], MEDIA_META) | padded(sized_media_bodies()), st.booleans())
def test_decode_media_on_built_headers_decodes_or_raises_wire_error(body: bytes, limited: bool) -> None:
    """Headers built from hostile parts, and valid bodies padded to MAX_HEADER_BYTES and one byte more.
    Caught mutations: the header-size check in `header_length` removed (a header of MAX_HEADER_BYTES
    + 1 was accepted); `_json` catching only JSONDecodeError (deep nesting raised RecursionError, a
    5000-digit number a plain ValueError); `_spec` accepting any list as shape and offsets (a string
    or null offset raised TypeError); the frame size check in `check_limits` removed."""
    _decode_media_or_wire_error(body, LIMITS if limited else None)


# ------------------------------------------------------------------------------------------ teacher server
@FUZZ
@seed(SEED)
@given(st.binary(max_size=200))
def test_decode_states_on_arbitrary_bytes_decodes_or_raises_wire_error(body: bytes) -> None:
    """Arbitrary bytes. Caught mutation: the short-body check in `header_length` removed (struct.error)."""
    _decode_states_or_wire_error(body)


@FUZZ
@seed(SEED)
@given(mutated(states_bodies()))
def test_decode_states_on_mutated_bodies_decodes_or_raises_wire_error(body: bytes) -> None:
    """Valid-looking teacher bodies, mutated. Caught mutations: the t-in-[0, 1] check removed from
    decode_states; the max-batch check in `check_states_header` removed (MAX_BATCH + 1 states were
    accepted); the prompt length check in `read_prompts` removed; `_json` catching only
    JSONDecodeError; the short-body check in `header_length` removed."""
    _decode_states_or_wire_error(body)


@FUZZ
@seed(SEED)
@given(built_headers(["states", "t"], ["prompts"]) | padded(states_bodies()))
def test_decode_states_on_built_headers_decodes_or_raises_wire_error(body: bytes) -> None:
    """Headers built from hostile parts, and valid bodies padded around MAX_HEADER_BYTES. Caught
    mutations: `_spec` accepting any list as shape and offsets (a null offset raised TypeError); the
    header-size check removed; `_json` catching only JSONDecodeError (RecursionError); the
    t-in-[0, 1], max-batch and prompt length checks removed."""
    _decode_states_or_wire_error(body)


# ------------------------------------------------------------------------------------------ fixed cases
@pytest.mark.parametrize(
    "text",
    ["[" * 100_000 + "]" * 100_000, "[" + "1" * 5000 + "]"],
    ids=["deep nesting", "5000-digit number"],
)
def test_hostile_prompt_json_is_a_wire_error(text: str) -> None:
    body = save_tensors(
        {"audio": torch.zeros(1, 1, 4)}, metadata={"prompts": text, "fps": "8", "sample_rate": "8"}
    )
    with pytest.raises(WireError, match="metadata 'prompts' is not JSON"):
        decode_media(body)


def test_a_header_over_the_limit_is_refused_before_parsing() -> None:
    body = struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{" + b" " * MAX_HEADER_BYTES + b"}"
    with pytest.raises(WireError, match=f"the limit is {MAX_HEADER_BYTES}"):
        decode_media(body)


def test_more_states_than_the_max_batch_is_too_large_from_the_header_alone() -> None:
    body = encode_states(
        torch.zeros(MAX_BATCH + 1, *LATENT), torch.zeros(MAX_BATCH + 1), ["a"] * (MAX_BATCH + 1)
    )
    prefix = body[: 8 + _header_bytes(body)]
    with pytest.raises(
        TooLarge, match=f"{MAX_BATCH + 1} states exceed the server's max batch of {MAX_BATCH}"
    ):
        check_states_header(read_header(prefix), LATENT, MAX_BATCH)
