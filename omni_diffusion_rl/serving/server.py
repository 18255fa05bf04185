"""`odrl serve-reward`: registered rewards over HTTP, with concurrent requests scored in batches.

Endpoints: GET /health (open), GET /info and POST /score/{name} (bearer token when one is set).
Requests for one reward queue up; a batcher takes the oldest, adds queued requests of the same
shape up to `max_batch` samples (waiting at most `max_wait_ms` after the oldest arrived), scores
them with one call on a worker thread and answers each request with its own rows. The model is
never called by two threads at once. A request whose batch fails is re-scored alone, so one bad
request does not fail the others.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
import logging
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch
from aiohttp import web

from ..media import MediaBatch
from ..reward import Reward, RewardError, RewardOutput, call_reward, checked_output
from .wire import WireError, decode_media, scores_to_json

logger = logging.getLogger(__name__)
API_VERSION = 1


@dataclass
class ServeSettings:
    host: str = "127.0.0.1"
    port: int = 8400
    max_batch: int = 32  # samples per model call
    max_wait_ms: float = 5.0  # how long the oldest request may wait for others to join its batch
    max_request_mb: float = 256.0
    max_in_flight: int = 256  # requests being read, queued or scored; more get 503 (clients retry)
    token: str | None = None

    def check(self) -> None:
        if self.max_batch < 1 or self.max_wait_ms < 0 or self.max_request_mb <= 0 or self.max_in_flight < 1:
            raise ValueError("max_batch and max_in_flight must be >= 1, max_wait_ms >= 0, max_request_mb > 0")
        if not self.token and not is_loopback(self.host):
            raise ValueError(
                f"refusing to serve on {self.host} without a token: anyone who reaches it could use it. "
                "Set one in the environment (ODRL_REWARD_TOKEN, or --token-env NAME), or bind 127.0.0.1"
            )


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class _Request:
    media: MediaBatch
    prompts: list[str]
    future: asyncio.Future[RewardOutput]
    arrived: float = field(default_factory=time.monotonic)

    def signature(self) -> tuple[Any, ...]:
        """Requests can share a model call when everything but the batch size agrees."""
        m = self.media
        return (
            None if m.video is None else tuple(m.video.shape[1:]),
            None if m.audio is None else tuple(m.audio.shape[1:]),
            m.fps,
            m.sample_rate,
        )


@dataclass
class BatchStats:
    requests: int = 0
    samples: int = 0
    model_calls: int = 0
    failed_requests: int = 0
    model_seconds: float = 0.0  # inside the reward's score call (merging, preprocessing, model)

    def as_dict(self) -> dict[str, float]:
        mean = self.samples / self.model_calls if self.model_calls else 0.0
        return {**self.__dict__, "model_seconds": round(self.model_seconds, 4), "mean_batch": round(mean, 3)}


class RewardBatcher:
    """Collects the requests for one reward and scores compatible ones with a single call."""

    def __init__(self, name: str, reward: Reward, max_batch: int, max_wait_ms: float) -> None:
        self.name = name
        self.reward = reward
        self.max_batch = max_batch
        self.max_wait_s = max_wait_ms / 1000
        self.stats = BatchStats()
        self._queue: deque[_Request] = deque()
        self._arrival = asyncio.Event()
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"reward-{name}")
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._worker.shutdown(wait=False, cancel_futures=True)

    async def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        request = _Request(media, prompts, asyncio.get_running_loop().create_future())
        self._queue.append(request)
        self._arrival.set()
        self.stats.requests += 1
        return await request.future

    def _take_batch(self) -> list[_Request]:
        """The oldest request and queued ones of the same signature, up to max_batch samples."""
        first = self._queue.popleft()
        batch, size, key = [first], len(first.media), first.signature()
        for request in list(self._queue):
            if size + len(request.media) > self.max_batch:
                break
            if request.signature() == key:
                self._queue.remove(request)
                batch.append(request)
                size += len(request.media)
        return batch

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            while not self._queue:
                self._arrival.clear()
                await self._arrival.wait()
            deadline = self._queue[0].arrived + self.max_wait_s
            # Requests queued while the model was busy go at once; a lone one waits for company, briefly.
            while sum(len(r.media) for r in self._queue) < self.max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._arrival.clear()
                try:
                    await asyncio.wait_for(self._arrival.wait(), remaining)
                except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
                    break
            batch = [r for r in self._take_batch() if not r.future.done()]  # done: the client left
            try:
                if batch:
                    await self._score_batch(loop, batch)
            except Exception as e:  # never let the batcher die: fail this batch, serve the next
                logger.exception("reward '%s': batch of %d requests failed", self.name, len(batch))
                for request in batch:
                    _settle(request.future, error=e)

    async def _score_batch(self, loop: asyncio.AbstractEventLoop, batch: list[_Request]) -> None:
        prompts = [p for r in batch for p in r.prompts]
        try:
            out = await loop.run_in_executor(self._worker, self._call, [r.media for r in batch], prompts)
        except Exception as e:
            if len(batch) == 1:
                self.stats.failed_requests += 1
                logger.warning("reward '%s' failed on a request: %s: %s", self.name, type(e).__name__, e)
                _settle(batch[0].future, error=e)
                return
            for request in batch:  # find the request that fails; the others are answered
                await self._score_batch(loop, [request])
            return
        start = 0
        for request in batch:
            rows = slice(start, start + len(request.media))
            start = rows.stop
            part = RewardOutput(out.scores[rows], {k: v[rows] for k, v in out.components.items()})
            _settle(request.future, result=part)

    def _call(self, parts: list[MediaBatch], prompts: list[str]) -> RewardOutput:
        start = time.perf_counter()
        media = _merge(parts)
        self.stats.model_calls += 1
        self.stats.samples += len(media)
        try:
            with torch.inference_mode():
                return checked_output(self.name, call_reward(self.reward, media, prompts), len(media))
        finally:
            self.stats.model_seconds += time.perf_counter() - start


def _settle(
    future: asyncio.Future[RewardOutput],
    result: RewardOutput | None = None,
    error: BaseException | None = None,
) -> None:
    if future.done():  # the client went away
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


def _merge(parts: list[MediaBatch]) -> MediaBatch:
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    return MediaBatch(
        video=None if first.video is None else torch.cat([p.video for p in parts]),  # type: ignore[misc]
        audio=None if first.audio is None else torch.cat([p.audio for p in parts]),  # type: ignore[misc]
        fps=first.fps,
        sample_rate=first.sample_rate,
    )


def _error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response({"error": message, "kind": kind}, status=status)


def build_app(rewards: dict[str, Reward], settings: ServeSettings) -> web.Application:
    """The aiohttp application serving `rewards` (name -> reward object)."""
    settings.check()
    max_bytes = int(settings.max_request_mb * 2**20)
    batchers = {
        name: RewardBatcher(name, reward, settings.max_batch, settings.max_wait_ms)
        for name, reward in rewards.items()
    }
    in_flight = 0

    @web.middleware
    async def authorise(request: web.Request, handler: Any) -> web.StreamResponse:
        if settings.token and request.path != "/health":
            given = request.headers.get("Authorization", "")
            expected = f"Bearer {settings.token}"
            if not hmac.compare_digest(given.encode(), expected.encode()):
                what = "no bearer token" if not given else "a wrong bearer token"
                return _error(
                    401, f"this server needs 'Authorization: Bearer <token>'; got {what}", "unauthorised"
                )
        return await handler(request)

    async def health(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def info(_: web.Request) -> web.Response:
        return web.json_response(
            {
                "api_version": API_VERSION,
                "rewards": sorted(batchers),
                "max_batch": settings.max_batch,
                "max_wait_ms": settings.max_wait_ms,
                "max_request_bytes": max_bytes,
                "stats": {name: b.stats.as_dict() for name, b in batchers.items()},
            }
        )

    async def score(request: web.Request) -> web.Response:
        nonlocal in_flight
        if in_flight >= settings.max_in_flight:
            return _error(503, f"busy: {in_flight} requests in flight; retry later", "busy")
        in_flight += 1
        try:
            return await score_one(request)
        finally:
            in_flight -= 1

    async def score_one(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name not in batchers:
            return _error(
                404, f"this server does not serve reward '{name}'; it serves {sorted(batchers)}", "unknown"
            )
        if request.content_length is not None and request.content_length > max_bytes:
            return _too_large(request.content_length, max_bytes)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return _too_large(None, max_bytes)
        try:  # parsing and checks off the event loop: they touch every value of up to max_request_mb
            media, prompts = await asyncio.get_running_loop().run_in_executor(None, decode_media, body)
        except WireError as e:
            return _error(400, str(e), "bad_request")
        if len(media) > settings.max_batch:
            message = (
                f"{len(media)} samples exceed the server's max batch of {settings.max_batch}; send fewer"
            )
            return _error(413, message, "too_large")
        try:
            out = await batchers[name].score(media, prompts)
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

    app = web.Application(middlewares=[authorise], client_max_size=max_bytes)
    app.router.add_get("/health", health)
    app.router.add_get("/info", info)
    app.router.add_post("/score/{name}", score)

    async def lifecycle(_: web.Application) -> Any:
        for b in batchers.values():
            b.start()
        yield
        for b in batchers.values():
            await b.stop()

    app.cleanup_ctx.append(lifecycle)
    return app


def _too_large(size: int | None, limit: int) -> web.Response:
    got = f"{size} bytes" if size is not None else "more"
    return _error(
        413,
        f"request of {got} exceeds the server's limit of {limit} bytes; send smaller batches or start "
        "the server with a larger --max-request-mb",
        "too_large",
    )


async def serve(rewards: dict[str, Reward], settings: ServeSettings, ready: Any = None) -> None:
    """Serve until cancelled; prints one JSON line `{"event": "ready", "url": ...}` once listening."""
    # handler_cancellation: a request whose client went away is cancelled, so the batcher skips it.
    runner = web.AppRunner(build_app(rewards, settings), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, settings.host, settings.port)
    await site.start()
    sockets = site._server.sockets if site._server is not None else []  # noqa: SLF001 - the bound port
    port = sockets[0].getsockname()[1] if sockets else settings.port
    url = f"http://{settings.host}:{port}"
    print(json.dumps({"event": "ready", "url": url, "rewards": sorted(rewards)}), flush=True)
    if ready is not None:
        ready(url)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main_serve(rewards: dict[str, Reward], settings: ServeSettings) -> int:
    try:
        asyncio.run(serve(rewards, settings))
    except KeyboardInterrupt:
        print("reward server stopped", file=sys.stderr)
    return 0
