"""The HTTP client under RemoteReward and RemoteTeacher (serving/http_client.py), against a real
aiohttp server on 127.0.0.1 in a thread of this process: retries, giving up with a sentence, the
token, the bound on what an answer may hold, connections reused and closed."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pytest
import torch
from aiohttp import web

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.reward import run_on_background_loop
from omni_diffusion_rl.serving import http_client
from omni_diffusion_rl.serving.client import RemoteReward, RewardServerError
from omni_diffusion_rl.serving.http_client import (
    MAX_ANSWER_BYTES,
    AnswerTooLarge,
    GaveUp,
    HttpClient,
    backoff_delay_s,
    bearer_token,
    with_retries,
)
from omni_diffusion_rl.serving.teacher_client import RemoteTeacher, TeacherServerMismatch

T = TypeVar("T")
BIG = 4 << 20  # bytes of the oversized answers: more than the client's read-ahead, so they cannot be in
LIMIT = 64 << 10  # what the client reads of them


@dataclass
class Seen:
    """What the test server saw: connections (one protocol object each), headers, failures left."""

    connections: list[Any] = field(default_factory=list)
    authorization: list[str | None] = field(default_factory=list)
    failures_left: int = 0
    info_bytes: int = 0  # /info answers this many bytes when set
    info_body: bytes = b""  # /info answers this body when set

    def open_connections(self) -> int:
        return sum(1 for c in self.connections if c.transport is not None and not c.transport.is_closing())


def _app(seen: Seen) -> web.Application:
    @web.middleware
    async def record(request: web.Request, handler: Any) -> web.StreamResponse:
        if not any(c is request.protocol for c in seen.connections):
            seen.connections.append(request.protocol)
        seen.authorization.append(request.headers.get("Authorization"))
        return await handler(request)

    async def flaky(_: web.Request) -> web.Response:
        if seen.failures_left > 0:
            seen.failures_left -= 1
            return web.json_response({"error": "busy"}, status=503)
        return web.json_response({"ok": True})

    async def big(_: web.Request) -> web.Response:
        return web.Response(body=b"x" * BIG)

    async def big_chunked(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b"x" * (64 << 10)
        for _ in range(BIG // len(chunk)):
            await response.write(chunk)
        await response.write_eof()
        return response

    async def slow(_: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async def info(_: web.Request) -> web.Response:
        if seen.info_bytes:
            return web.Response(body=b"{" * seen.info_bytes, content_type="application/json")
        if seen.info_body:
            return web.Response(body=seen.info_body, content_type="application/json")
        return web.json_response({"rewards": ["busy"]})

    app = web.Application(middlewares=[record])
    app.router.add_get("/flaky", flaky)
    app.router.add_get("/big", big)
    app.router.add_get("/big-chunked", big_chunked)
    app.router.add_get("/slow", slow)
    app.router.add_get("/info", info)
    app.router.add_post("/score/busy", flaky)
    return app


@pytest.fixture
def server() -> Iterator[tuple[str, Seen]]:
    """(url, what it saw) of a test server on 127.0.0.1 at a free port, on its own thread and loop."""
    seen, loop = Seen(), asyncio.new_event_loop()
    runner = web.AppRunner(_app(seen), access_log=None, shutdown_timeout=0.5)
    ports: list[int] = []

    async def start() -> None:
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        ports.append(site._server.sockets[0].getsockname()[1])  # type: ignore[union-attr]  # noqa: SLF001

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(start(), loop).result(timeout=10)
    try:
        yield f"http://127.0.0.1:{ports[0]}", seen
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()


def _run(coro_fn: Callable[[], Awaitable[T]]) -> T:
    """coro_fn() on the clients' background loop, as RemoteReward and RemoteTeacher run."""

    async def main() -> T:
        return await coro_fn()

    return run_on_background_loop(main())


class _Busy(Exception):
    """The test's retryable answer."""


def _flaky(client: HttpClient, url: str) -> Callable[[], Awaitable[dict[str, Any]]]:
    async def attempt() -> dict[str, Any]:
        answer = await client.get(f"{url}/flaky", timeout_s=5)
        if answer.status == 503:
            raise _Busy(f"HTTP {answer.status}")
        return json.loads(answer.body)

    return attempt


def _wait_for(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)
    return condition()


def test_a_failing_request_is_retried_with_backoff_until_it_succeeds(
    server: tuple[str, Seen], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = server
    seen.failures_left = 2
    client = HttpClient(None)
    waits: list[float] = []  # the backoff before each attempt, as with_retries asked for it
    real_backoff = http_client.backoff

    async def recorded_backoff(attempt: int, backoff_s: float, max_backoff_s: float) -> None:
        waits.append(backoff_delay_s(attempt, backoff_s, max_backoff_s))
        await real_backoff(attempt, backoff_s, max_backoff_s)

    monkeypatch.setattr(http_client, "backoff", recorded_backoff)
    answer = _run(lambda: with_retries(_flaky(client, url), 3, 0.05, 1.0, "late", retry_on=(_Busy,)))
    assert answer == {"ok": True} and seen.failures_left == 0
    assert waits == [0.0, 0.05, 0.1], "three attempts: at once, after 0.05 s, then after 0.1 s"
    client.close()


def test_the_backoff_doubles_from_its_first_wait_up_to_its_cap() -> None:
    assert [backoff_delay_s(k, 0.5, 3.0) for k in range(6)] == [0.0, 0.5, 1.0, 2.0, 3.0, 3.0]


def test_the_client_gives_up_after_the_last_retry_saying_how_the_last_attempt_failed(
    server: tuple[str, Seen],
) -> None:
    url, seen = server
    seen.failures_left = 10
    client = HttpClient(None)
    with pytest.raises(GaveUp) as gave_up:
        _run(lambda: with_retries(_flaky(client, url), 2, 0.01, 1.0, "late", retry_on=(_Busy,)))
    assert gave_up.value.attempts == 3 and gave_up.value.last == "_Busy: HTTP 503"
    assert seen.failures_left == 7

    async def slow() -> Any:
        return await client.get(f"{url}/slow", timeout_s=0.2)

    with pytest.raises(GaveUp, match=r"2 attempts over .* s; last error: no answer within 0.2 s"):
        _run(lambda: with_retries(slow, 1, 0.01, 1.0, "no answer within 0.2 s"))
    client.close()


def test_a_reward_server_that_stays_busy_stops_the_run_with_a_sentence(server: tuple[str, Seen]) -> None:
    url, seen = server
    seen.failures_left = 10
    reward = RemoteReward(url, "busy", retries=1, backoff_s=0.01)
    clip = MediaBatch(audio=torch.zeros(1, 1, 100), sample_rate=8000)
    with pytest.raises(RewardServerError) as refused:
        reward.score(clip, ["a"])
    assert str(refused.value).startswith(
        f"reward server {url} (for reward 'busy'): POST /score/busy failed 2 times over "
    )
    assert "last error: _Retryable: HTTP 503: busy. Is `odrl serve-reward busy` running there?" in str(
        refused.value
    )
    reward.close()


def test_the_token_is_sent_only_when_one_is_set(
    server: tuple[str, Seen], monkeypatch: pytest.MonkeyPatch
) -> None:
    url, seen = server
    monkeypatch.delenv("ODRL_TEST_TOKEN", raising=False)
    assert bearer_token(None, "ODRL_TEST_TOKEN") is None
    monkeypatch.setenv("ODRL_TEST_TOKEN", "")
    assert bearer_token(None, "ODRL_TEST_TOKEN") is None
    monkeypatch.setenv("ODRL_TEST_TOKEN", "from-env")
    assert bearer_token(None, "ODRL_TEST_TOKEN") == "from-env"
    assert bearer_token("given", "ODRL_TEST_TOKEN") == "given"
    for token in (None, "", "s3cret"):
        client = HttpClient(token)
        _run(lambda c=client: c.get(f"{url}/flaky", timeout_s=5))
        client.close()
    assert seen.authorization == [None, None, "Bearer s3cret"]


@pytest.mark.parametrize(("path", "size"), [("/big", BIG), ("/big-chunked", None)])
def test_an_answer_larger_than_the_bound_is_refused_and_its_connection_closed(
    server: tuple[str, Seen], path: str, size: int | None
) -> None:
    url, seen = server
    client = HttpClient(None)
    with pytest.raises(AnswerTooLarge) as refused:
        _run(lambda: client.get(url + path, timeout_s=5, max_bytes=LIMIT))
    body = f"a body of {size} bytes" if size else "a longer body"
    assert str(refused.value) == f"answered 200 with {body}, more than the {LIMIT} bytes this client reads"
    assert _wait_for(lambda: seen.open_connections() == 0)
    assert _run(lambda: client.get(url + path, timeout_s=5, max_bytes=BIG)).body == b"x" * BIG
    client.close()


def test_an_oversized_answer_is_a_sentence_for_rewards_and_teachers(server: tuple[str, Seen]) -> None:
    url, seen = server
    seen.info_bytes = MAX_ANSWER_BYTES + 1
    too_large = f"answered 200 with a body of {seen.info_bytes} bytes, more than the {MAX_ANSWER_BYTES} bytes"
    reward = RemoteReward(url, "", retries=3)
    with pytest.raises(RewardServerError) as refused:
        reward.info()
    assert str(refused.value) == f"reward server {url}: GET /info {too_large} this client reads"
    reward.close()
    with pytest.raises(TeacherServerMismatch) as mismatch:
        RemoteTeacher([url], retries=0, token_env="ODRL_TEST_UNSET_TOKEN")
    assert str(mismatch.value) == (
        f"teacher server {url} {too_large} this client reads at /info: is it an `odrl serve-teacher` server?"
    )


def _teacher_info(**fields: Any) -> dict[str, Any]:
    return {"latent_shape": [4, 8], "layout": "L", "convention": "C", "fingerprint": "F", **fields}


NESTED = b"[" * 100_000 + b"]" * 100_000
HOSTILE_INFO = {  # a teacher server's /info -> what the sentence names
    "nested 100,000 deep": (
        b'{"teachers": {"policy": ' + NESTED + b"}}",
        "nests lists and objects more than 32 deep",
    ),
    "NaN in the shape": (
        json.dumps({"teachers": {"policy": _teacher_info(latent_shape=[float("nan")])}}).encode(),
        "NaN is not a JSON number",
    ),
    "not UTF-8": (b'{"teachers": "\xff"}', "is not UTF-8 text"),
    "a shape of fractions": (
        json.dumps({"teachers": {"policy": _teacher_info(latent_shape=[1.5, 2])}}).encode(),
        "latent_shape [1.5, 2] (it must be a list of 1 to 8 whole numbers from 1 to 2147483647)",
    ),
    "a layout that is a number": (
        json.dumps({"teachers": {"policy": _teacher_info(layout=7)}}).encode(),
        "layout 7 (it must be text of 1 to 4096 characters)",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE_INFO))
def test_a_hostile_info_is_a_sentence_for_teachers_and_rewards(server: tuple[str, Seen], case: str) -> None:
    """What a server's /info holds is read within bounds: deep nesting, NaN, bytes that are not text
    or fields of the wrong kind are a sentence naming what is wrong, never a RecursionError or a
    garbled conversion message."""
    url, seen = server
    seen.info_body, fragment = HOSTILE_INFO[case]
    with pytest.raises(TeacherServerMismatch) as mismatch:
        RemoteTeacher([url], retries=0, token_env="ODRL_TEST_UNSET_TOKEN")
    assert fragment in str(mismatch.value) and f"teacher server {url}" in str(mismatch.value), mismatch.value
    if case in ("nested 100,000 deep", "not UTF-8"):  # the same reader under the reward client
        reward = RemoteReward(url, "", retries=0)
        with pytest.raises(RewardServerError, match=fragment):
            reward.info()
        reward.close()


def test_requests_reuse_one_connection_and_close_cleanly(server: tuple[str, Seen]) -> None:
    url, seen = server
    client = HttpClient("s3cret")
    answers = [_run(lambda: client.get(f"{url}/flaky", timeout_s=5)) for _ in range(5)]
    assert [a.new_connection for a in answers] == [True, False, False, False, False]
    assert len(seen.connections) == 1 and seen.open_connections() == 1
    session = client._session  # noqa: SLF001 - what close() must close
    client.close()
    assert session is not None and session.closed
    assert _wait_for(lambda: seen.open_connections() == 0), "the server still holds the connection"
    again = _run(lambda: client.get(f"{url}/flaky", timeout_s=5))
    assert again.new_connection and len(seen.connections) == 2  # it reconnects when used again
    client.close()
    client.close()  # twice is fine


def test_a_client_refuses_another_event_loop_while_its_own_runs(server: tuple[str, Seen]) -> None:
    url, _ = server
    client = HttpClient(None)
    _run(lambda: client.get(f"{url}/flaky", timeout_s=5))
    with pytest.raises(RuntimeError, match="belong to another running event loop"):
        asyncio.run(client.get(f"{url}/flaky", timeout_s=5))
    client.close()
