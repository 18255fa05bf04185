"""The teacher server's wire format: states, times and prompts in, velocities out, as safetensors
bytes (never a pickle), checked before any model sees them.

Request: `states` [B, *latent] and `t` [B] (float16/bfloat16/float32, finite, t in [0, 1]) with
metadata `prompts` (a JSON list of B strings of at most MAX_PROMPT_CHARS characters each). Answer:
`velocity` [B, *latent] float32. The header alone settles everything but the values
(`check_states_header`), so the server checks it before receiving the rest of the body.
"""

from __future__ import annotations

import json
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from .wire import (
    Header,
    TooLarge,
    WireError,
    check_finite,
    check_spec,
    load_checked,
    read_header,
    read_prompts,
)

EXPECTS = "'prompts' (a JSON list of strings)"


def encode_states(states: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> bytes:
    tensors = {
        "states": states.detach().to("cpu", torch.float32).contiguous(),
        "t": t.detach().to("cpu", torch.float32).contiguous(),
    }
    return save_tensors(tensors, metadata={"prompts": json.dumps(list(prompts))})


def check_states_header(
    header: Header, latent_shape: tuple[int, ...], max_batch: int | None = None
) -> tuple[int, list[str]]:
    """The batch size and prompts a teacher request's header declares, checked: exactly `states`
    [B, *latent_shape] and `t` [B] as floats, B in [1, max_batch] (more: TooLarge, a 413) and B
    prompts of at most MAX_PROMPT_CHARS characters."""
    specs = header.tensors
    if set(specs) != {"states", "t"}:
        names = sorted(n[:40] for n in specs)[:5]
        raise WireError(f"the payload must hold exactly 'states' and 't'; got {names}")
    states, t = specs["states"], specs["t"]
    layout = f"[B, {', '.join(str(d) for d in latent_shape)}] (this teacher's latent)"
    check_spec("states", states, 1 + len(latent_shape), layout)
    if tuple(states.shape[1:]) != tuple(latent_shape):
        raise WireError(f"'states' must be {layout}; got shape {list(states.shape)}")
    batch = states.shape[0]
    check_spec("t", t, 1, "[B]")
    if t.shape[0] != batch:
        raise WireError(f"'t' must be [B] with B = {batch}; got shape {list(t.shape)}")
    if batch == 0:
        raise WireError("the batch is empty (0 states)")
    if max_batch is not None and batch > max_batch:
        raise TooLarge(f"{batch} states exceed the server's max batch of {max_batch}; send fewer")
    return batch, read_prompts(header.metadata, batch, "states")


def decode_states(
    body: bytes, latent_shape: tuple[int, ...], max_batch: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """The states, times and prompts of a request for a teacher working on `latent_shape`, or a
    WireError naming what is wrong (a TooLarge beyond `max_batch` states)."""
    header = read_header(body, EXPECTS)
    _, prompts = check_states_header(header, latent_shape, max_batch)
    tensors = load_checked(body, header)
    states, t = tensors["states"], tensors["t"]
    check_finite("states", states)
    check_finite("t", t.reshape(-1, 1))
    if bool(((t < 0) | (t > 1)).any()):
        raise WireError("'t' must lie in [0, 1] (1 is pure noise)")
    return states.float(), t.float(), prompts


def encode_velocity(velocity: torch.Tensor) -> bytes:
    return save_tensors({"velocity": velocity.detach().to("cpu", torch.float32).contiguous()})


def decode_velocity(body: bytes, shape: tuple[int, ...]) -> torch.Tensor:
    """The server's answer for states of `shape`; a ValueError when it is not that or not finite."""
    try:
        tensors = _load(body)
    except WireError as e:
        raise ValueError(f"the teacher server's answer is not a safetensors payload: {e}") from e
    v = tensors.get("velocity")
    if v is None or tuple(v.shape) != tuple(shape) or not v.is_floating_point():
        got = None if v is None else list(v.shape)
        raise ValueError(f"the teacher server answered velocity {got} for states {list(shape)}")
    if not bool(torch.isfinite(v).all()):
        raise ValueError("the teacher server answered non-finite velocities")
    return v.float()


def _load(body: bytes) -> dict[str, Any]:
    try:
        return load_tensors(body)
    except Exception as e:  # safetensors raises its own error type for malformed payloads
        raise WireError(f"the body is not a valid safetensors payload: {e}") from e
