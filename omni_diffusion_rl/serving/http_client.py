"""The HTTP client under the reward and teacher clients: one aiohttp session per client, reused
across requests on the event loop that made it (the process's background loop), a timeout per
request, the bearer token when one is set, answers read up to a size bound, and retries with
exponential backoff. What an answer means (which statuses to retry, what to tell the user) stays
with the caller.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import time
import weakref
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, TypeVar

import aiohttp

from ..reward import background_loop, run_on_background_loop
from .wire import CONTENT_TYPE

T = TypeVar("T")
# Idle connections are dropped before the server's keepalive_timeout_s (15 s by default) closes them,
# so a request never goes out on a connection the server is closing at that moment.
KEEPALIVE_S = 10.0
MAX_ANSWER_BYTES = 32 << 20  # a JSON answer (scores, /info, an error) is far smaller
MAX_ANSWER_DEPTH = 32  # lists and objects in a JSON answer: the servers' nest at most 4 deep
TIMEOUTS = (TimeoutError, asyncio.TimeoutError)  # distinct classes before Python 3.11
TRANSPORT_ERRORS = (aiohttp.ClientError, ConnectionError)  # the server was not reached, or went away
_SESSIONS: weakref.WeakSet[aiohttp.ClientSession] = weakref.WeakSet()


@atexit.register
def _close_sessions() -> None:
    """Close connections left open at exit (a client not closed after an error)."""
    sessions = [s for s in _SESSIONS if not s.closed]
    loop = background_loop()
    if sessions and loop.is_running():

        async def close_all() -> None:
            await asyncio.gather(*(s.close() for s in sessions), return_exceptions=True)

        asyncio.run_coroutine_threadsafe(close_all(), loop).result(timeout=5)


def bearer_token(token: str | None, env: str) -> str | None:
    """`token` when given, else the value of the environment variable `env` (None when unset or empty)."""
    return token if token is not None else os.environ.get(env) or None


class AnswerTooLarge(Exception):
    """A server answered more bytes than the client reads for that request."""

    def __init__(self, status: int, size: int | None, limit: int) -> None:
        body = f"a body of {size} bytes" if size is not None else "a longer body"
        super().__init__(f"answered {status} with {body}, more than the {limit} bytes this client reads")
        self.status, self.size, self.limit = status, size, limit


class GaveUp(Exception):
    """Every attempt failed: `last` says how the last one did, `seconds` how long they all took."""

    def __init__(self, last: str, attempts: int, seconds: float) -> None:
        super().__init__(f"{attempts} attempts over {seconds:.1f} s; last error: {last}")
        self.last, self.attempts, self.seconds = last, attempts, seconds


@dataclass(frozen=True)
class Answer:
    """A server's whole answer; new_connection: the request went out on a connection it opened."""

    status: int
    body: bytes
    new_connection: bool


class HttpClient:
    """Requests to HTTP servers over one session, made on first use on the running event loop and
    kept until `close()`. token: sent as 'Authorization: Bearer <token>' when not empty;
    connections: open connections at most (0: no limit)."""

    def __init__(self, token: str | None, connections: int = 100) -> None:
        self.token = token
        self.connections = connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def get(self, url: str, timeout_s: float, max_bytes: int = MAX_ANSWER_BYTES) -> Answer:
        return await self._request("GET", url, timeout_s, max_bytes)

    async def post(
        self, url: str, body: bytes, timeout_s: float, max_bytes: int = MAX_ANSWER_BYTES
    ) -> Answer:
        """POST a safetensors `body`."""
        headers = {"Content-Type": CONTENT_TYPE}
        return await self._request("POST", url, timeout_s, max_bytes, data=body, headers=headers)

    def close(self) -> None:
        """Close the connections (made on the background loop; call from any other thread); the next
        request opens new ones."""
        session, self._session = self._session, None
        if session is not None and not session.closed:
            run_on_background_loop(session.close())

    async def _request(
        self, method: str, url: str, timeout_s: float, max_bytes: int, **kwargs: Any
    ) -> Answer:
        session = await self._session_here()
        connection = SimpleNamespace(new=False)  # set by the session's trace when it connects anew
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.request(
            method, url, timeout=timeout, trace_request_ctx=connection, **kwargs
        ) as resp:
            body = await _read_bounded(resp, max_bytes)
        return Answer(resp.status, body, connection.new)

    async def _session_here(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        session = self._session
        if session is not None and not session.closed and self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed():
                raise RuntimeError(
                    "this HttpClient's connections belong to another running event loop: use it from the "
                    "loop it was first used on (the background loop of omni_diffusion_rl.reward)"
                )
            session = None  # its loop is gone, and its connections with it
        if session is None or session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=self.connections)
            trace = aiohttp.TraceConfig()
            trace.on_connection_create_end.append(_mark_new_connection)
            session = aiohttp.ClientSession(headers=headers, connector=connector, trace_configs=[trace])
            self._session, self._loop = session, loop
            _SESSIONS.add(session)  # closed at exit if the caller does not
        return session


def backoff_delay_s(attempt: int, backoff_s: float, max_backoff_s: float) -> float:
    """The wait before attempt `attempt` (0 is the first, and waits 0): backoff_s * 2^(attempt - 1),
    at most max_backoff_s."""
    return min(max_backoff_s, backoff_s * 2 ** (attempt - 1)) if attempt else 0.0


async def backoff(attempt: int, backoff_s: float, max_backoff_s: float) -> None:
    """Before attempt `attempt`: wait backoff_delay_s(...)."""
    if attempt:
        await asyncio.sleep(backoff_delay_s(attempt, backoff_s, max_backoff_s))


async def with_retries(
    attempt: Callable[[], Awaitable[T]],
    retries: int,
    backoff_s: float,
    max_backoff_s: float,
    timed_out: str,
    retry_on: tuple[type[BaseException], ...] = (),
) -> T:
    """attempt()'s result; a timeout (described as `timed_out`), a transport error or one of
    `retry_on` is retried with backoff, anything else raised at once. GaveUp after the last retry."""
    start, last = time.monotonic(), ""
    for k in range(retries + 1):
        await backoff(k, backoff_s, max_backoff_s)
        try:
            return await attempt()
        except TIMEOUTS:
            last = timed_out
        except (*TRANSPORT_ERRORS, *retry_on) as e:
            last = f"{type(e).__name__}: {e}"
    raise GaveUp(last, retries + 1, time.monotonic() - start)


async def _read_bounded(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The answer's body, or AnswerTooLarge past `limit` bytes (the rest unread: the connection is
    closed unless the whole answer had arrived already)."""
    if resp.content_length is not None and resp.content_length > limit:
        resp.close()
        raise AnswerTooLarge(resp.status, resp.content_length, limit)
    chunks, size = [], 0
    async for chunk in resp.content.iter_any():
        size += len(chunk)
        if size > limit:
            resp.close()
            raise AnswerTooLarge(resp.status, None, limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def _mark_new_connection(_session: Any, context: Any, _params: Any) -> None:
    """A request opened a new connection: its Answer says so."""
    if isinstance(context.trace_request_ctx, SimpleNamespace):
        context.trace_request_ctx.new = True
