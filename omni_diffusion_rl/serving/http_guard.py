"""What every request to a server passes before its work starts: the token, the content type, a
body bounded and read within its time, refusals answered (and the rest of a refused body dropped)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from .wire import (
    CONTENT_TYPE,
    Header,
    TooLarge,
    WireError,
    header_length,
)

logger = logging.getLogger(__name__)


CLOSE_WAIT_S = 0.5  # at shutdown, after the requests being scored were answered: for the rest to go


LINGER_BYTES = 4 << 20  # a refused request's unread rest up to this: read and dropped, the connection kept


LINGER_S = (
    2.0  # a larger rest: read and dropped this long at most after the answer, then the connection closes
)


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": message, "kind": kind}, status=status)


def _authorise(token: str | None) -> Any:
    """The middleware asking every request but /health for 'Authorization: Bearer <token>' (when
    a token is set)."""

    @web.middleware
    async def authorise(request: web.Request, handler: Any) -> web.StreamResponse:
        if token and request.path != "/health":
            problem = _authorisation_problem(request.headers.get("Authorization"), token)
            if problem is not None:
                message = f"this server needs 'Authorization: Bearer <token>'; got {problem}"
                return await _refuse(request, _error(401, message, "unauthorised"))
        return await handler(request)

    return authorise


def _too_large_message(size: int | None, limit: int) -> str:
    got = f"{size} bytes" if size is not None else "more"
    return (
        f"request of {got} exceeds the server's limit of {limit} bytes; send smaller batches or start "
        "the server with a larger --max-request-mb"
    )


def _too_large(size: int | None, limit: int) -> web.Response:
    return _error(413, _too_large_message(size, limit), "too_large")


def _wire_error(e: WireError) -> web.Response:
    return _error(e.status, str(e), "too_large" if e.status == 413 else "bad_request")


def _authorisation_problem(given: str | None, token: str) -> str | None:
    """None when the Authorization header `given` carries `token`; else what is wrong with it."""
    if not given:
        return "no bearer token"
    if not (given.isascii() and given.isprintable()):
        return "an Authorization header with characters outside printable ASCII, which no token has"
    if not given.startswith("Bearer "):
        return "an Authorization header that is not 'Bearer <token>'"
    if not hmac.compare_digest(given.encode("ascii"), f"Bearer {token}".encode("ascii")):
        return "a wrong bearer token"
    return None


def _content_type_refusal(request: web.Request) -> web.Response | None:
    """None when the body is declared safetensors, or not declared at all (raw HTTP clients); a 415
    naming the expected type otherwise."""
    given = request.headers.get("Content-Type")
    if given is None or given.split(";", 1)[0].strip().lower() == CONTENT_TYPE:
        return None
    message = (
        f"this server reads safetensors bodies of Content-Type '{CONTENT_TYPE}'; got {given[:100]!r}. "
        f"Send the body with 'Content-Type: {CONTENT_TYPE}'"
    )
    return _error(415, message, "unsupported_media_type")


async def _read_checked(request: web.Request, precheck: Callable[[bytes], Header], max_bytes: int) -> bytes:
    """The request's body. Its first 8 + header-length bytes go to `precheck` (on a worker thread)
    before the rest is received, so a request refused by its header costs no more than that; then
    exactly the payload the header declares is received: a body of another length is refused before
    its rest is read (padding after a valid header is never received)."""
    stream = request.content
    prefix = await _read_up_to(stream, 8)
    prefix += await _read_up_to(stream, header_length(prefix, request.content_length))
    header = await asyncio.get_running_loop().run_in_executor(None, precheck, prefix)
    declared = header.payload_bytes
    if declared > max_bytes:
        raise TooLarge(_too_large_message(declared, max_bytes))
    length = request.content_length
    if length is not None and length != declared:
        raise WireError(_length_mismatch(f"the body is {length} bytes", header))
    rest = await _read_up_to(stream, declared - len(prefix))
    if len(prefix) + len(rest) < declared:
        raise WireError(_length_mismatch(f"the body ended after {len(prefix) + len(rest)} bytes", header))
    if length is None and await stream.readany():  # chunked: nothing may follow the payload
        raise WireError(_length_mismatch("the chunked body goes on", header))
    return prefix + rest


def _length_mismatch(what: str, header: Header) -> str:
    data = header.payload_bytes - header.size
    return (
        f"{what}, but its safetensors header declares a payload of {header.payload_bytes} bytes "
        f"({header.size} of header, {data} of tensor data): send the payload alone, whole"
    )


async def _read_up_to(stream: Any, size: int) -> bytes:
    """`size` bytes of the body, or fewer where it ends (the header checks then say what is short)."""
    try:
        return await stream.readexactly(size)
    except asyncio.IncompleteReadError as e:
        return e.partial


async def _refuse(request: web.Request, response: web.Response) -> web.Response:
    """Answer a request whose body is left (partly) unread. A rest of up to LINGER_BYTES is read and
    dropped after the answer (aiohttp's lingering) and the connection kept; a larger rest, or one of
    unknown size, is not worth receiving: the connection is closed, after at most LINGER_S of
    reading and dropping, so that a client still sending gets the answer rather than a reset."""
    if not request.body_exists:
        return response
    length = request.content_length
    if length is not None and length - request.content.total_bytes <= LINGER_BYTES:
        return response
    return await _answer_and_close(request, response, linger_s=LINGER_S)


async def _answer_and_close(
    request: web.Request, response: web.Response, linger_s: float = 0.0
) -> web.Response:
    """Send `response`, then close the connection: its request body was not read to the end, so the
    connection cannot carry another request. With `linger_s`, the answer is followed by a half-close
    and what the client still sends is read and dropped for up to that long first (closing with
    unread data resets the connection, and a client still sending may lose the answer)."""
    response.force_close()
    await response.prepare(request)
    await response.write_eof()
    if linger_s > 0:
        await _drop_rest(request, linger_s)
    request.protocol.force_close()
    return response


async def _drop_rest(request: web.Request, seconds: float) -> None:
    """Half-close the connection and read and drop the rest of the body for up to `seconds`."""
    transport = request.transport
    if transport is None or transport.is_closing() or not transport.can_write_eof():
        return
    transport.write_eof()
    deadline = time.monotonic() + seconds
    try:
        while (left := deadline - time.monotonic()) > 0:
            if not await asyncio.wait_for(request.content.readany(), left):
                return
    except (TimeoutError, asyncio.TimeoutError, ConnectionError, aiohttp.ClientError, OSError):
        return  # out of time, or the client went away: either way nothing more to drop
