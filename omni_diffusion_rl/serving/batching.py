"""Concurrent requests for one model answered in batches: a batcher takes the oldest request, adds
queued ones of the same shape up to max_batch samples (waiting at most max_wait_ms), calls the
model once on its own thread and gives each request its rows; a batch that fails is retried alone."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..media import MediaBatch
from ..reward import (
    Reward,
    RewardOutput,
    call_reward,
    checked_output,
)

logger = logging.getLogger(__name__)


T = TypeVar("T")


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
