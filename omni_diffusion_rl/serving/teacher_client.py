"""A teacher served by one or more `odrl serve-teacher` replicas, with the teacher contract
(`info`, `velocity`) and an asynchronous scheduler that routes requests across the replicas.

A velocity call is cut into requests of at most `request_samples` states, sent concurrently. Each
request goes to the healthy replica with the fewest samples outstanding (so a slow replica, whose
requests stay outstanding longer, gets fewer; at most `window` requests wait at a replica, the
rest here), waits at most `timeout_s`, and on a timeout,
connection error or 5xx is retried on another replica, up to `retries` times. A replica that failed
leaves the rotation and comes back once its /health answers (checked every `health_every_s`). When
no replica is left, a TeacherUnavailable names each one and why it is out. A 4xx (a malformed
request, a wrong token) is not retried: it is a bug or a setup error, raised at once.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import torch

from ..reward import run_on_background_loop
from ..teacher import TeacherInfo, TeacherMismatch
from .client import _SESSIONS, KEEPALIVE_S, server_base_url
from .teacher_wire import decode_velocity, encode_states
from .wire import CONTENT_TYPE

HEALTH_TIMEOUT_S = 2.0
WAIT_S = 0.002  # between looks for a free replica slot
BACKOFF_S, MAX_BACKOFF_S = 0.2, 5.0  # before attempt k + 1: BACKOFF_S * 2^k, at most MAX_BACKOFF_S


class TeacherUnavailable(RuntimeError):
    """No teacher replica could answer (all down or failing)."""


class TeacherRequestRejected(ValueError):
    """A teacher server refused a request (4xx): retrying elsewhere cannot help."""


@dataclass
class Replica:
    url: str
    healthy: bool = True
    outstanding: int = 0  # samples sent and not yet answered
    in_flight: int = 0  # requests sent and not yet answered
    requests: int = 0
    samples: int = 0
    failures: int = 0
    seconds: float = 0.0  # waiting for its answers
    last_error: str = ""
    checked_at: float = field(default=0.0)  # last /health probe while out of rotation


class ReplicaPool:
    """Which replica gets the next request: among the healthy ones not yet tried for it with fewer
    than `window` requests in flight, the one with the fewest outstanding samples (ties: fewest
    requests so far). The window keeps requests queued here rather than at a slow replica, so a
    replica that answers sooner takes more of them."""

    def __init__(self, urls: list[str], window: int = 2) -> None:
        if not urls:
            raise ValueError("teacher.urls is empty: give at least one teacher server")
        self.replicas = [Replica(server_base_url(u)) for u in urls]
        self.window, self.retries = window, 0

    def candidates(self, tried: set[str]) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.url not in tried]

    def pick(self, tried: set[str]) -> Replica | None:
        ready = [r for r in self.candidates(tried) if r.in_flight < self.window]
        return min(ready, key=lambda r: (r.outstanding, r.requests), default=None)

    def fail(self, replica: Replica, reason: str) -> None:
        replica.healthy, replica.failures, replica.last_error = False, replica.failures + 1, reason
        replica.checked_at = time.monotonic()

    def due_for_check(self, every_s: float) -> list[Replica]:
        now = time.monotonic()
        return [r for r in self.replicas if not r.healthy and now - r.checked_at >= every_s]

    def describe_down(self) -> str:
        return "; ".join(f"{r.url}: {r.last_error or 'down'}" for r in self.replicas if not r.healthy)

    def stats(self) -> dict[str, float]:
        out: dict[str, float] = {"teacher/retries": float(self.retries)}
        for i, r in enumerate(self.replicas):
            out[f"teacher/replica{i}/samples"] = float(r.samples)
            out[f"teacher/replica{i}/requests"] = float(r.requests)
            out[f"teacher/replica{i}/failures"] = float(r.failures)
        return out


class RemoteTeacher:
    """Teacher `name` on the servers at `urls` (scheme://host:port each); window: requests in flight
    per replica at most (the rest wait here for the first free replica)."""

    def __init__(
        self,
        urls: list[str],
        name: str = "policy",
        token: str | None = None,
        timeout_s: float = 60.0,
        retries: int = 3,
        request_samples: int = 16,
        health_every_s: float = 1.0,
        window: int = 2,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or request_samples < 1 or health_every_s <= 0:
            raise ValueError(
                "teacher: timeout_s and health_every_s must be > 0, retries >= 0, request_samples >= 1"
            )
        self.pool = ReplicaPool(list(urls), window)
        self.name, self.timeout_s, self.retries = name, timeout_s, retries
        self.request_samples, self.health_every_s = request_samples, health_every_s
        self.token = token if token is not None else os.environ.get("ODRL_TEACHER_TOKEN") or None
        self._session: aiohttp.ClientSession | None = None
        self._info = run_on_background_loop(self._agreed_info())

    # ------------------------------------------------------------------ the teacher contract
    def info(self) -> TeacherInfo:
        return self._info

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        return run_on_background_loop(
            self.velocity_async(x_t.detach().cpu(), t.detach().cpu(), list(prompts))
        )

    def stats(self) -> dict[str, float]:
        return self.pool.stats()

    def close(self) -> None:
        session, self._session = self._session, None
        if session is not None and not session.closed:
            run_on_background_loop(session.close())

    # ------------------------------------------------------------------ async
    async def velocity_async(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        n = self.request_samples
        tasks = [
            asyncio.ensure_future(self._request(x_t[s : s + n], t[s : s + n], prompts[s : s + n]))
            for s in range(0, len(x_t), n)
        ]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        return torch.cat(parts)

    async def _request(self, x: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        body, tried = encode_states(x, t, prompts), set()
        await self._check_down()  # replicas out of rotation rejoin once /health answers (rate-limited)
        for attempt in range(self.retries + 1):
            if attempt:
                self.pool.retries += 1
                await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (attempt - 1)))
            replica = await self._next_replica(tried)
            if replica is None:
                raise TeacherUnavailable(
                    f"no teacher replica of '{self.name}' is left ({self.pool.describe_down()}); start "
                    "`odrl serve-teacher` again where teacher.urls points, the run continues from its last "
                    "checkpoint with --resume"
                )
            tried.add(replica.url)
            replica.outstanding += len(x)
            replica.in_flight += 1
            started = time.perf_counter()
            try:
                v = await self._post(replica, body, tuple(x.shape))
            except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
                self.pool.fail(replica, f"no answer within teacher.timeout_s={self.timeout_s:g} s")
                continue
            except _Busy:  # the replica is fine, only busy or stopping: try again, elsewhere if possible
                continue
            except (aiohttp.ClientError, ConnectionError, _ServerFault) as e:
                self.pool.fail(replica, f"{type(e).__name__}: {e}")
                continue
            finally:
                replica.outstanding -= len(x)
                replica.in_flight -= 1
                replica.seconds += time.perf_counter() - started
            replica.requests += 1
            replica.samples += len(x)
            return v
        raise TeacherUnavailable(
            f"teacher '{self.name}': a request failed {self.retries + 1} times "
            f"({self.pool.describe_down() or 'replicas busy'}); teacher.retries and teacher.timeout_s set "
            "the patience"
        )

    async def _next_replica(self, tried: set[str]) -> Replica | None:
        """A replica for the next attempt: an untried one when there is one (waiting for a free slot),
        else any healthy one; with none healthy, the down ones are probed once their check is due."""
        while True:
            replica = self.pool.pick(tried)
            if replica is not None:
                return replica
            if self.pool.candidates(tried):  # untried ones exist but are all busy
                await asyncio.sleep(WAIT_S)
                continue
            if self.pool.candidates(set()):  # every healthy one was tried: try one again
                tried.clear()
                continue
            due = self.pool.due_for_check(self.health_every_s)
            if not due:  # wait for the next health check of a down replica, then probe
                await asyncio.sleep(self.health_every_s)
            await self._check_down()
            if not self.pool.candidates(set()):
                return None

    async def _post(self, replica: Replica, body: bytes, shape: tuple[int, ...]) -> torch.Tensor:
        session = await self._session_here()
        async with session.post(
            f"{replica.url}/velocity/{self.name}",
            data=body,
            headers={"Content-Type": CONTENT_TYPE},
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        ) as resp:
            answer = await resp.read()
            if resp.status in (429, 503):
                raise _Busy(f"HTTP {resp.status}")
            if resp.status >= 500 or resp.status == 408:
                raise _ServerFault(f"HTTP {resp.status}: {answer[:300].decode(errors='replace')}")
            if resp.status != 200:
                hint = (
                    " (set the token in ODRL_TEACHER_TOKEN or teacher.token_env)"
                    if resp.status == 401
                    else ""
                )
                text = answer[:300].decode(errors="replace")
                raise TeacherRequestRejected(
                    f"teacher server {replica.url} answered {resp.status}: {text}{hint}"
                )
        try:
            return decode_velocity(answer, shape)
        except ValueError as e:
            raise _ServerFault(str(e)) from e

    async def _check_down(self) -> None:
        """Probe /health of the replicas out of rotation whose last probe is old enough."""
        session = await self._session_here()

        async def probe(replica: Replica) -> None:
            replica.checked_at = time.monotonic()
            try:
                async with session.get(
                    f"{replica.url}/health", timeout=aiohttp.ClientTimeout(total=HEALTH_TIMEOUT_S)
                ) as resp:
                    if resp.status == 200:
                        replica.healthy = True
            except (aiohttp.ClientError, ConnectionError, TimeoutError, asyncio.TimeoutError) as e:
                replica.last_error = f"/health: {type(e).__name__}: {e}"

        await asyncio.gather(*(probe(r) for r in self.pool.due_for_check(self.health_every_s)))

    async def _agreed_info(self) -> TeacherInfo:
        """Every replica's /info must serve this teacher and describe the same one."""
        session = await self._session_here()
        seen: dict[str, TeacherInfo] = {}
        for replica in self.pool.replicas:
            try:
                async with session.get(
                    f"{replica.url}/info", timeout=aiohttp.ClientTimeout(total=self.timeout_s)
                ) as resp:
                    data: Any = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise TeacherRequestRejected(
                            f"teacher server {replica.url} answered {resp.status}: {data}"
                        )
            except (
                aiohttp.ClientError,
                ConnectionError,
                TimeoutError,
                asyncio.TimeoutError,
                ValueError,
            ) as e:
                raise TeacherUnavailable(
                    f"teacher server {replica.url} does not answer /info ({type(e).__name__}: {e}); start "
                    f"`odrl serve-teacher {self.name}` there or fix teacher.urls"
                ) from e
            served = data.get("teachers", {}) if isinstance(data, dict) else {}
            if self.name not in served:
                raise TeacherMismatch(
                    f"teacher server {replica.url} does not serve '{self.name}'; it serves {sorted(served)}"
                )
            seen[replica.url] = TeacherInfo.from_dict(served[self.name])
        infos = set(seen.values())
        if len(infos) > 1:
            listing = "; ".join(f"{u}: {i.fingerprint}" for u, i in seen.items())
            raise TeacherMismatch(f"the teacher replicas serve different models (fingerprints {listing})")
        return infos.pop()

    async def _session_here(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
            connector = aiohttp.TCPConnector(keepalive_timeout=KEEPALIVE_S, limit=0)
            self._session = aiohttp.ClientSession(headers=headers, connector=connector)
            _SESSIONS.add(self._session)  # closed at exit if the caller does not
        return self._session


class _Busy(Exception):
    """The replica answered 503 or 429: busy or stopping, not broken."""


class _ServerFault(Exception):
    """A replica-side failure worth another replica (5xx, 408/429, a malformed answer)."""
