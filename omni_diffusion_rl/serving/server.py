"""`odrl serve-reward` and `odrl serve-teacher`: registered rewards and teachers over HTTP, with
concurrent requests answered in batches.

Endpoints: GET /health (open), GET /info, POST /score/{name} (rewards) and POST /velocity/{name}
(teachers: teacher_wire.py), with a bearer token when one is set. Requests for one model queue
up; a batcher takes the oldest, adds queued requests of the same shape up to `max_batch` samples
(waiting at most `max_wait_ms` after the oldest arrived), answers them with one call on a worker
thread and gives each request its own rows. The model is never called by two threads at once. A
request whose batch fails is answered alone, so one bad request does not fail the others.

One request's work is bounded, not only its bytes: a request's safetensors header is read and checked
(on a worker thread) before the rest of its body, so the batch size, the prompts (MAX_PROMPT_CHARS
each) and the media against the reward's declared `input_limits` (frame size; video pixels and audio
values per request, at most `max_batch` of its largest samples) are refused with a 400 or 413 before
the body is received; decoding and the value checks run on worker threads too, so the event loop
(and /health) never waits on them. A body that is not declared safetensors gets 415, a missing or
malformed Authorization header (a token is set) 401, each with a sentence.

Slow or idle clients cannot hold the server: a request counts against `max_in_flight` only once its
body has arrived, a body not in within `read_timeout_s` gets 408 and its connection is closed, and a
connection that sends no complete request headers (idle keep-alive, or half-sent headers) for
`keepalive_timeout_s` is closed. On Ctrl-C, requests being scored get `shutdown_timeout_s` to be
answered and the rest get 503 (clients retry); then every connection is closed and the process exits,
abandoning a model call still running.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import ipaddress
import json
import logging
import math
import queue
import sys
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
import torch
from aiohttp import web

from ..media import MediaBatch
from ..reward import (
    Reward,
    RewardError,
    RewardOutput,
    call_reward,
    checked_output,
    declared_modality,
    input_limits,
)
from .teacher_wire import EXPECTS as STATES_EXPECTS
from .teacher_wire import check_states_header, decode_states, encode_velocity
from .wire import (
    CONTENT_TYPE,
    MAX_HEADER_BYTES,
    MAX_PROMPT_CHARS,
    MAX_TEXT_CHARS,
    Header,
    TooLarge,
    WireError,
    check_media_header,
    decode_media,
    header_length,
    read_header,
    scores_to_json,
)

logger = logging.getLogger(__name__)
API_VERSION = 1
MAX_WAIT_MS = 60_000.0  # a batch waits at most a minute to fill (--max-wait-ms)
CLOSE_WAIT_S = 0.5  # at shutdown, after the requests being scored were answered: for the rest to go
LINGER_BYTES = 4 << 20  # a refused request's unread rest up to this: read and dropped, the connection kept
LINGER_S = (
    2.0  # a larger rest: read and dropped this long at most after the answer, then the connection closes
)
T = TypeVar("T")
TOKEN_HELP = (
    "set one in the environment, e.g. "
    "`export ODRL_REWARD_TOKEN=$(python -c 'import secrets; print(secrets.token_urlsafe(32))')`"
)


@dataclass
class ServeSettings:
    """What `odrl serve-reward` serves with; `check()` refuses settings that cannot work or are unsafe."""

    host: str = "127.0.0.1"
    port: int = 8400
    max_batch: int = 32  # samples per model call
    max_wait_ms: float = 5.0  # how long the oldest request may wait for others to join its batch
    max_request_mb: float = 256.0
    max_in_flight: int = 256  # requests read (body in) and not yet answered; more get 503 (clients retry)
    max_uploads_mb: float = (
        4096.0  # bodies arriving at once, by declared size (chunked: max_request_mb); more: 503
    )
    token: str | None = None
    read_timeout_s: float = 30.0  # to receive a request's body once its headers are in; slower: 408, closed
    keepalive_timeout_s: float = 15.0  # a connection without a complete request (headers) for this is closed
    shutdown_timeout_s: float = 2.0  # on Ctrl-C, requests being scored get this long to be answered
    service_ms: float = 0.0  # teachers: a fixed time added per model call (a remote accelerator's stand-in)

    def check(self) -> None:
        if self.max_batch < 1 or self.max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be >= 1")
        if not (math.isfinite(self.max_wait_ms) and 0 <= self.max_wait_ms <= MAX_WAIT_MS):
            # nan: every lone request waited out the client's timeout; inf: it was never answered
            raise ValueError(
                f"max_wait_ms (--max-wait-ms) must be a number of milliseconds from 0 to {MAX_WAIT_MS:g}; "
                f"got {self.max_wait_ms}"
            )
        if not (math.isfinite(self.max_request_mb) and self.max_request_mb > 0):
            raise ValueError(
                f"max_request_mb (--max-request-mb) must be a number of MB above 0: {self.max_request_mb}"
            )
        if not (math.isfinite(self.max_uploads_mb) and self.max_uploads_mb >= self.max_request_mb):
            raise ValueError(
                f"max_uploads_mb ({self.max_uploads_mb}) must be a number of MB at least max_request_mb "
                f"({self.max_request_mb}), or no request of the largest size could ever be received"
            )
        if not (math.isfinite(self.service_ms) and self.service_ms >= 0):
            raise ValueError(f"service_ms must be a number of milliseconds >= 0; got {self.service_ms}")
        for name in ("read_timeout_s", "keepalive_timeout_s", "shutdown_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{name} must be a positive number of seconds; got {value}")
        if self.token is not None:
            _check_token(self.token)
        if not self.token and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without a token: anyone who reaches it could use it. "
                "Set one in the environment (ODRL_REWARD_TOKEN, or --token-env NAME), or bind 127.0.0.1"
            )


def _check_token(token: str) -> None:
    """Refuse a token a client could not send as given: empty, with whitespace, or not printable ASCII."""
    if not token.strip():
        raise ValueError(f"the reward server's token is empty or only whitespace; {TOKEN_HELP}")
    if any(c.isspace() for c in token):
        raise ValueError(
            "the reward server's token contains whitespace (leading, trailing or inside), which "
            f"'Authorization: Bearer <token>' cannot carry as given; {TOKEN_HELP}"
        )
    if not all("!" <= c <= "~" for c in token):
        raise ValueError(
            f"the reward server's token has characters outside printable ASCII, which HTTP headers cannot "
            f"carry reliably; {TOKEN_HELP}"
        )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class TeacherError(RuntimeError):
    """The served teacher answered something that is not a velocity per state."""


class ServerStopping(Exception):
    """The server is stopping: a request it had not answered yet gets 503 (the client retries)."""


@dataclass
class _Request:
    payload: Any  # what the batcher's model call takes for this request
    size: int  # its samples
    key: tuple[Any, ...]  # requests share a model call when their keys agree
    future: asyncio.Future[Any]
    arrived: float = field(default_factory=time.monotonic)


def media_signature(media: MediaBatch) -> tuple[Any, ...]:
    """Media requests can share a model call when everything but the batch size agrees."""
    return (
        None if media.video is None else tuple(media.video.shape[1:]),
        None if media.audio is None else tuple(media.audio.shape[1:]),
        media.fps,
        media.sample_rate,
        media.text is not None,  # answers batch only with answers
    )


@dataclass
class BatchStats:
    requests: int = 0
    samples: int = 0
    model_calls: int = 0
    failed_requests: int = 0
    model_seconds: float = 0.0  # inside the model call (merging, preprocessing, model)

    def as_dict(self) -> dict[str, float]:
        mean = self.samples / self.model_calls if self.model_calls else 0.0
        return {**self.__dict__, "model_seconds": round(self.model_seconds, 4), "mean_batch": round(mean, 3)}


class Batcher:
    """Collects the requests for one served model and answers compatible ones with a single call on
    its own thread; a subclass says how payloads make one call (`_call`: one result per request)."""

    kind = "model"

    def __init__(self, name: str, max_batch: int, max_wait_ms: float) -> None:
        self.name = name
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.stats = BatchStats()
        self._queue: deque[_Request] = deque()
        self._arrival = asyncio.Event()
        self._worker = _ModelThread(f"{self.kind}-{name}")
        self._task: asyncio.Task[None] | None = None
        self._running: list[_Request] = []  # the batch being computed
        self._stopping = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._worker.stop()

    def abandon(self) -> None:
        """Answer every queued or running request with ServerStopping, and any later one too."""
        self._stopping = True
        for request in [*self._queue, *self._running]:
            _settle(request.future, error=ServerStopping(f"the {self.kind} server is stopping; retry later"))
        self._queue.clear()

    async def submit(self, payload: Any, size: int, key: tuple[Any, ...]) -> Any:
        if self._stopping:
            raise ServerStopping(f"the {self.kind} server is stopping; retry later")
        request = _Request(payload, size, key, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        self._arrival.set()
        self.stats.requests += 1
        return await request.future

    def _take_batch(self) -> list[_Request]:
        """The oldest request and queued ones with the same key, up to max_batch samples."""
        first = self._queue.popleft()
        batch, size = [first], first.size
        for request in list(self._queue):
            if size + request.size > self.max_batch:
                break
            if request.key == first.key:
                self._queue.remove(request)
                batch.append(request)
                size += request.size
        return batch

    async def _run(self) -> None:
        while True:
            while not self._queue:
                self._arrival.clear()
                await self._arrival.wait()
            deadline = self._queue[0].arrived + self.max_wait_s
            # Requests queued while the model was busy go at once; a lone one waits for company, briefly.
            while sum(r.size for r in self._queue) < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), remaining)
                except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
                    break
            batch = [r for r in self._take_batch() if not r.future.done()]  # done: the client left
            self._running = batch
            try:
                if batch:
                    await self._compute(batch)
            except Exception as e:  # never let the batcher die: fail this batch, serve the next
                logger.exception("%s '%s': batch of %d requests failed", self.kind, self.name, len(batch))
                for request in batch:
                    _settle(request.future, error=e)
            finally:
                self._running = []

    async def _compute(self, batch: list[_Request]) -> None:
        try:
            results = await self._worker.run(self._timed_call, [r.payload for r in batch])
        except Exception as e:
            if len(batch) == 1:
                self.stats.failed_requests += 1
                logger.warning(
                    "%s '%s' failed on a request: %s: %s", self.kind, self.name, type(e).__name__, e
                )
                _settle(batch[0].future, error=e)
                return
            for request in batch:  # find the request that fails; the others are answered
                await self._compute([request])
            return
        for request, result in zip(batch, results, strict=True):
            _settle(request.future, result=result)

    def _timed_call(self, payloads: list[Any]) -> list[Any]:
        start = time.perf_counter()
        self.stats.model_calls += 1
        try:
            with torch.inference_mode():
                return self._call(payloads)
        finally:
            self.stats.model_seconds += time.perf_counter() - start

    def _call(self, payloads: list[Any]) -> list[Any]:
        raise NotImplementedError


class RewardBatcher(Batcher):
    """Scores media batches with one reward."""

    kind = "reward"

    def __init__(self, name: str, reward: Reward, max_batch: int, max_wait_ms: float) -> None:
        super().__init__(name, max_batch, max_wait_ms)
        self.reward = reward

    async def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        return await self.submit((media, prompts), len(media), media_signature(media))

    def _call(self, payloads: list[Any]) -> list[RewardOutput]:
        media = _merge([m for m, _ in payloads])
        prompts = [p for _, ps in payloads for p in ps]
        self.stats.samples += len(media)
        out = checked_output(self.name, call_reward(self.reward, media, prompts), len(media))
        results, start = [], 0
        for part, _ in payloads:
            rows = slice(start, start + len(part))
            start = rows.stop
            results.append(RewardOutput(out.scores[rows], {k: v[rows] for k, v in out.components.items()}))
        return results


class TeacherBatcher(Batcher):
    """Velocity targets from one teacher; `service_ms` adds a fixed time per model call (a stand-in
    for a remote accelerator's latency in benchmarks; 0 for real use)."""

    kind = "teacher"

    def __init__(
        self, name: str, teacher: Any, max_batch: int, max_wait_ms: float, service_ms: float = 0.0
    ) -> None:
        super().__init__(name, max_batch, max_wait_ms)
        self.teacher, self.service_s = teacher, service_ms / 1000

    async def velocity(self, states: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return await self.submit((states, t, prompts), len(states), ())

    def _call(self, payloads: list[Any]) -> list[torch.Tensor]:
        states = torch.cat([p[0] for p in payloads])
        t = torch.cat([p[1] for p in payloads])
        prompts = [text for p in payloads for text in p[2]]
        self.stats.samples += len(states)
        if self.service_s:
            time.sleep(self.service_s)
        v = self.teacher.velocity(states, t, prompts).float().cpu()
        if v.shape != states.shape or not bool(torch.isfinite(v).all()):
            raise TeacherError(  # a broken teacher: 500, never a silent target
                f"teacher '{self.name}' answered {tuple(v.shape)} (finite: {bool(torch.isfinite(v).all())}) "
                f"for states {tuple(states.shape)}"
            )
        return list(v.split([len(p[0]) for p in payloads]))


class _ModelThread:
    """One daemon thread that runs a reward's model calls one at a time, in order.

    Daemon, unlike a ThreadPoolExecutor's threads (joined at exit): a model call still running when the
    server stops does not keep the process alive until it ends.
    """

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def run(self, fn: Callable[..., T], *args: Any) -> asyncio.Future[T]:
        """fn(*args) on the thread; the future (of the running loop) gets its result or exception."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def stop(self) -> None:
        """Skip the queued calls; the thread ends after the call it is running, if any."""
        self._stopped = True
        self._jobs.put(None)

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            if self._stopped:
                continue
            try:
                result, error = fn(*args), None
            except BaseException as e:  # handed to the awaiting coroutine, which decides
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: the server stopped while this call ran
                return


def _settle(
    future: asyncio.Future[Any],
    result: Any = None,
    error: BaseException | None = None,
) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _merge(parts: list[MediaBatch]) -> MediaBatch:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return MediaBatch(
        video=None if first.video is None else torch.cat([p.video for p in parts]),  # type: ignore[misc]
        audio=None if first.audio is None else torch.cat([p.audio for p in parts]),  # type: ignore[misc]
        fps=first.fps,
        sample_rate=first.sample_rate,
        text=None if first.text is None else [t for p in parts for t in p.text or []],
    )


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": message, "kind": kind}, status=status)


class _Service:
    """One server's state: its batchers and limits, and the requests being received and answered.
    Its handlers make the routes of `build_app`."""

    def __init__(
        self, rewards: dict[str, Reward], settings: ServeSettings, teachers: dict[str, Any] | None
    ) -> None:
        self.settings = settings
        self.max_bytes = int(settings.max_request_mb * 2**20)
        self.max_arriving = int(settings.max_uploads_mb * 2**20)
        self.batchers = {
            name: RewardBatcher(name, reward, settings.max_batch, settings.max_wait_ms)
            for name, reward in rewards.items()
        }
        self.teacher_batchers = {
            name: TeacherBatcher(name, teacher, settings.max_batch, settings.max_wait_ms, settings.service_ms)
            for name, teacher in (teachers or {}).items()
        }
        self.every_batcher: list[Batcher] = [*self.batchers.values(), *self.teacher_batchers.values()]
        self.limits = {name: input_limits(reward) for name, reward in rewards.items()}
        self.modalities = {name: declared_modality(reward) for name, reward in rewards.items()}
        self.latents = {
            name: tuple(b.teacher.info().latent_shape) for name, b in self.teacher_batchers.items()
        }
        self.in_flight = 0  # requests whose body has been read, until answered
        self.reading = 0  # requests whose body is arriving
        self.arriving = 0  # their declared bytes (a chunked body counts as max_request_mb)

    # ------------------------------------------------------------------ routes
    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(self, _: web.Request) -> web.Response:
        settings = self.settings
        return web.json_response(
            {
                "api_version": API_VERSION,
                "rewards": sorted(self.batchers),
                "teachers": {name: b.teacher.info().to_dict() for name, b in self.teacher_batchers.items()},
                "max_batch": settings.max_batch,
                "max_wait_ms": settings.max_wait_ms,
                "max_request_bytes": self.max_bytes,
                "max_header_bytes": MAX_HEADER_BYTES,
                "max_prompt_chars": MAX_PROMPT_CHARS,
                "max_text_chars": MAX_TEXT_CHARS,
                "input_limits": {
                    name: lim.per_request(settings.max_batch) for name, lim in self.limits.items()
                },
                "modalities": self.modalities,
                "max_in_flight": settings.max_in_flight,
                "in_flight": self.in_flight,
                "reading": self.reading,
                "arriving_mb": round(self.arriving / 2**20, 3),
                "stats": {b.name: b.stats.as_dict() for b in self.every_batcher},
            }
        )

    async def score(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(
            request, self.batchers, "reward", self.media_precheck, self.media_decode, self.score_media
        )

    async def velocity(self, request: web.Request) -> web.StreamResponse:
        return await self.handle(
            request,
            self.teacher_batchers,
            "teacher",
            self.states_precheck,
            self.states_decode,
            self.velocity_of,
        )

    # ------------------------------------------------------------------ receiving a request
    def busy(self) -> web.Response | None:
        if self.in_flight < self.settings.max_in_flight:
            return None
        return _error(503, f"busy: {self.in_flight} requests in flight; retry later", "busy")

    async def receive(
        self, request: web.Request, precheck: Callable[[bytes], Header]
    ) -> bytes | web.Response:
        """The request's body once it has arrived, or the answer refusing it (busy, too large, slow,
        or a header that `precheck` refuses: then the rest of the body is not received)."""
        if request.content_length is not None and request.content_length > self.max_bytes:
            return await _refuse(request, _too_large(request.content_length, self.max_bytes))
        refusal = self.busy()  # before the upload too: no point receiving a body that would get 503
        if refusal is not None:
            return await _refuse(request, refusal)
        # Only a request whose body has arrived counts as in flight: uploads that stall cannot crowd
        # out the others, and each one is cut off after read_timeout_s. What may be arriving at once
        # is bounded by max_uploads_mb, so uploads cannot exhaust memory.
        declared = self.max_bytes if request.content_length is None else request.content_length
        if self.arriving + declared > self.max_arriving:
            message = (
                f"busy: {self.arriving / 2**20:.1f} MB of request bodies are arriving (max_uploads_mb="
                f"{self.settings.max_uploads_mb:g}); retry later"
            )
            return await _answer_and_close(request, _error(503, message, "busy"))
        self.reading += 1
        self.arriving += declared
        refusal = None
        try:
            body = await self.read_in_time(request, precheck)
        except WireError as e:  # refused by its header, or a body of another length than it declares
            refusal = _wire_error(e)
        finally:
            self.reading -= 1
            self.arriving -= declared
        if refusal is not None:  # what is left of the body is dropped, not held: no longer arriving
            return await _refuse(request, refusal)
        if isinstance(body, web.Response):  # too slow: answered, and its connection closed
            return body
        return self.busy() or body

    async def read_in_time(
        self, request: web.Request, precheck: Callable[[bytes], Header]
    ) -> bytes | web.Response:
        """The body, once `precheck` passed its header; a body not in within read_timeout_s gets 408,
        and its connection is closed."""
        timeout_s = self.settings.read_timeout_s
        try:
            return await asyncio.wait_for(_read_checked(request, precheck, self.max_bytes), timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            size = "chunked" if request.content_length is None else f"{request.content_length} bytes"
            message = (
                f"the request body ({size}) did not arrive within read_timeout_s={timeout_s:g} "
                "s of its headers; closing the connection"
            )
            return await _answer_and_close(request, _error(408, message, "timeout"))

    async def handle(
        self,
        request: web.Request,
        known: dict[str, Any],
        what: str,
        precheck: Callable[[str, bytes], Header],
        decode: Callable[[str, bytes], Any],
        answer: Callable[[str, Any], Any],
    ) -> web.StreamResponse:
        """Receive a request for model `name` (its header checked by `precheck` first), decode it
        and have `answer` answer it; parsing and checks run on worker threads, off the event loop."""
        name = request.match_info["name"]
        if name not in known:
            message = f"this server does not serve {what} '{name}'; it serves {sorted(known)}"
            return await _refuse(request, _error(404, message, "unknown"))
        refusal = _content_type_refusal(request)
        if refusal is not None:
            return await _refuse(request, refusal)
        body = await self.receive(request, functools.partial(precheck, name))
        if isinstance(body, web.StreamResponse):
            return body
        self.in_flight += 1
        try:
            try:  # parsing and checks touch every value of up to max_request_mb: off the event loop
                decoded = await asyncio.get_running_loop().run_in_executor(None, decode, name, body)
            except WireError as e:
                return _wire_error(e)
            del body  # the decoded tensors are what the request holds while it waits
            return await answer(name, decoded)
        finally:
            self.in_flight -= 1

    def media_precheck(self, name: str, prefix: bytes) -> Header:
        header = read_header(prefix)
        check_media_header(header, self.limits[name], self.settings.max_batch, name)
        return header

    def media_decode(self, name: str, body: bytes) -> Any:
        return decode_media(body, self.limits[name], self.settings.max_batch, name)

    def states_precheck(self, name: str, prefix: bytes) -> Header:
        header = read_header(prefix, STATES_EXPECTS)
        check_states_header(header, self.latents[name], self.settings.max_batch)
        return header

    def states_decode(self, name: str, body: bytes) -> Any:
        return decode_states(body, self.latents[name], self.settings.max_batch)

    # ------------------------------------------------------------------ answering it
    async def score_media(self, name: str, decoded: tuple[MediaBatch, list[str]]) -> web.Response:
        try:
            out = await self.batchers[name].score(*decoded)
        except ServerStopping as e:
            return _error(503, str(e), "stopping")
        except RewardError as e:
            return _error(500, str(e), "reward_broken")
        except Exception as e:
            return _error(
                422, f"reward '{name}' could not score this batch: {type(e).__name__}: {e}", "reward_failed"
            )
        return web.json_response(
            {
                "scores": scores_to_json(out.scores),
                "components": {k: scores_to_json(v) for k, v in out.components.items()},
            }
        )

    async def velocity_of(
        self, name: str, decoded: tuple[torch.Tensor, torch.Tensor, list[str]]
    ) -> web.Response:
        try:
            v = await self.teacher_batchers[name].velocity(*decoded)
        except ServerStopping as e:
            return _error(503, str(e), "stopping")
        except TeacherError as e:  # a teacher that fails is an error for the client, never a silent target
            return _error(500, str(e), "teacher_failed")
        except ValueError as e:  # this request cannot be answered (e.g. a prompt the model refuses)
            return _error(422, f"teacher '{name}' refused this request: {e}", "teacher_refused")
        except Exception as e:
            return _error(500, f"teacher '{name}' failed: {type(e).__name__}: {e}", "teacher_failed")
        return web.Response(body=encode_velocity(v), content_type=CONTENT_TYPE)

    # ------------------------------------------------------------------ start and stop
    async def drain(self, _: web.Application) -> None:
        """On shutdown (the listening socket already closed): requests being answered get
        shutdown_timeout_s; the ones still waiting then get 503."""
        deadline = time.monotonic() + self.settings.shutdown_timeout_s
        while self.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for b in self.every_batcher:
            b.abandon()

    async def lifecycle(self, _: web.Application) -> AsyncIterator[None]:
        for b in self.every_batcher:
            b.start()
        yield
        for b in self.every_batcher:
            await b.stop()


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


def build_app(
    rewards: dict[str, Reward], settings: ServeSettings, teachers: dict[str, Any] | None = None
) -> web.Application:
    """The aiohttp application serving `rewards` (name -> reward object) at /score/{name} and
    `teachers` (name -> teacher, omni_diffusion_rl/teacher.py) at /velocity/{name}."""
    settings.check()
    service = _Service(rewards, settings, teachers)
    app = web.Application(middlewares=[_authorise(settings.token)], client_max_size=service.max_bytes)
    app.router.add_get("/health", service.health)
    app.router.add_get("/info", service.info)
    app.router.add_post("/score/{name}", service.score)
    app.router.add_post("/velocity/{name}", service.velocity)
    app.on_shutdown.append(service.drain)
    app.cleanup_ctx.append(service.lifecycle)
    return app


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


async def serve(
    rewards: dict[str, Reward],
    settings: ServeSettings,
    ready: Any = None,
    teachers: dict[str, Any] | None = None,
) -> None:
    """Serve until cancelled; prints one JSON line `{"event": "ready", "url": ...}` once listening."""
    # handler_cancellation: a request whose client went away is cancelled, so the batcher skips it.
    # keepalive_timeout: aiohttp closes a connection waiting for (the rest of) a request's headers that
    # long, from when it opened or answered its last request. shutdown_timeout: how long aiohttp waits
    # for requests in progress before cancelling them, after `drain` answered those being scored (what
    # is left: stalled uploads, answers being sent).
    runner = web.AppRunner(
        build_app(rewards, settings, teachers),
        access_log=None,
        handler_cancellation=True,
        keepalive_timeout=settings.keepalive_timeout_s,
        shutdown_timeout=CLOSE_WAIT_S,
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001 - the bound port
    port = sockets[0].getsockname()[1] if sockets else settings.port
    url = f"http://{settings.host}:{port}"
    served = {"rewards": sorted(rewards), "teachers": sorted(teachers or {})}
    threads = torch.get_num_threads()  # the budget it computes on (odrl serve-* --threads)
    print(json.dumps({"event": "ready", "url": url, **served, "threads": threads}), flush=True)
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main_serve(
    rewards: dict[str, Reward], settings: ServeSettings, teachers: dict[str, Any] | None = None
) -> int:
    try:
        asyncio.run(serve(rewards, settings, teachers=teachers))
    except KeyboardInterrupt:
        print(f"{'teacher' if teachers else 'reward'} server stopped", file=sys.stderr)
    return 0
