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
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from aiohttp import web

from ..media import MediaBatch
from ..reward import (
    Reward,
    RewardError,
    declared_modality,
    input_limits,
)
from .batching import Batcher, RewardBatcher, ServerStopping, TeacherBatcher, TeacherError
from .http_guard import (
    CLOSE_WAIT_S,
    _answer_and_close,
    _authorise,
    _content_type_refusal,
    _error,
    _read_checked,
    _refuse,
    _too_large,
    _wire_error,
)
from .settings import API_VERSION, ServeSettings
from .teacher_wire import EXPECTS as STATES_EXPECTS
from .teacher_wire import check_states_header, decode_states, encode_velocity
from .wire import (
    CONTENT_TYPE,
    MAX_HEADER_BYTES,
    MAX_PROMPT_CHARS,
    MAX_TEXT_CHARS,
    Header,
    WireError,
    check_media_header,
    decode_media,
    read_header,
    scores_to_json,
)

logger = logging.getLogger(__name__)


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
