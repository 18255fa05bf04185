"""A teacher served by one or more `odrl serve-teacher` replicas, with the teacher contract
(`info`, `velocity`) and an asynchronous scheduler that routes requests across the replicas.

A velocity call is cut into requests of at most `request_samples` states, sent concurrently. Each
request goes to the healthy replica with the fewest samples outstanding (so a slow replica, whose
requests stay outstanding longer, gets fewer; at most `window` requests wait at a replica, the rest
here, asleep until a request ends), waits at most `timeout_s`, and on a timeout, connection error,
5xx or an answer larger than its velocities is retried on another replica, up to `retries` times. A
replica that failed leaves the rotation and comes back once it is proven again (checked every
`health_every_s`): its /info must describe the teacher every replica described at start
(fingerprint, latent shape, layout, convention), so a replica restarted with another teacher stays
out, with a logged sentence. An answer that came over a new connection is used only once the replica
is proven the same way (a replica restarted between two requests is a new server). When no replica
is left, a TeacherUnavailable names each one and why it is out. A 4xx (a malformed request, a wrong
token) is not retried: it is a bug or a setup error, raised at once. Every error here is a
TeacherServerError, which `odrl` shows as one sentence."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..bounded_json import loads_bounded
from ..reward import run_on_background_loop
from ..teacher import TeacherInfo, TeacherMismatch
from .client import ServerURLError, server_base_url
from .http_client import (
    MAX_ANSWER_DEPTH,
    TIMEOUTS,
    TRANSPORT_ERRORS,
    AnswerTooLarge,
    HttpClient,
    backoff,
    bearer_token,
)
from .teacher_wire import decode_velocity, encode_states

HEALTH_TIMEOUT_S = 2.0
SLOT_WAIT_S = 0.25  # the longest a request waits for a freed slot before it looks again anyway
BACKOFF_S, MAX_BACKOFF_S = 0.2, 5.0  # before attempt k + 1: BACKOFF_S * 2^k, at most MAX_BACKOFF_S
ANSWER_ROOM = 64 * 1024  # a velocity answer's safetensors header, besides its float32 values
TOKEN_ENV = "ODRL_TEACHER_TOKEN"
logger = logging.getLogger(__name__)


class TeacherServerError(RuntimeError):
    """A teacher server could not be used: down, refusing, misaddressed or serving another teacher."""


class TeacherUnavailable(TeacherServerError):
    """No teacher replica could answer (all down or failing)."""


class TeacherRequestRejected(TeacherServerError):
    """A teacher server refused a request (4xx): retrying elsewhere cannot help."""


class TeacherServerMismatch(TeacherServerError, TeacherMismatch):
    """A teacher server serves another teacher than the run's, or none by that name."""


class TeacherURLError(TeacherServerError, ValueError):
    """teacher.urls is empty or holds a url that is not scheme://host:port."""


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
    checked_at: float = field(default=0.0)  # last probe while out of rotation
    logged: str = ""  # the refusal last logged for it (each is logged once)


class Wakeup:
    """Coroutines asleep until `wake_all` (or their timeout): requests waiting for a replica slot
    sleep here instead of polling, which on a host whose cores the replicas fill took CPU from them."""

    def __init__(self) -> None:
        self._sleepers: list[asyncio.Future[None]] = []

    async def wait(self, timeout_s: float) -> None:
        sleeper = asyncio.get_running_loop().create_future()
        self._sleepers.append(sleeper)
        try:
            await asyncio.wait_for(sleeper, timeout_s)
        except (TimeoutError, asyncio.TimeoutError):  # distinct classes before Python 3.11
            pass
        finally:
            if sleeper in self._sleepers:
                self._sleepers.remove(sleeper)

    def wake_all(self) -> None:
        sleepers, self._sleepers = self._sleepers, []
        for sleeper in sleepers:
            sleeper.get_loop().call_soon_threadsafe(_wake, sleeper)

    def __len__(self) -> int:
        return len(self._sleepers)


def _wake(sleeper: asyncio.Future[None]) -> None:
    if not sleeper.done():
        sleeper.set_result(None)


class ReplicaPool:
    """Which replica gets the next request: among the healthy ones not yet tried for it with fewer
    than `window` requests in flight, the one with the fewest outstanding samples (ties: fewest
    requests so far). The window keeps requests queued here rather than at a slow replica, so a
    replica that answers sooner takes more of them."""

    def __init__(self, urls: list[str], window: int = 2) -> None:
        if not urls:
            raise TeacherURLError("teacher.urls is empty: give at least one teacher server")
        self.replicas = [Replica(_teacher_url(u)) for u in urls]
        self.window, self.retries = window, 0
        self.slot_freed = Wakeup()

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
    per replica at most (the rest wait here for the first free replica); token: the servers' bearer
    token (default: the environment variable token_env)."""

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
        token_env: str = TOKEN_ENV,
    ) -> None:
        if timeout_s <= 0 or retries < 0 or request_samples < 1 or health_every_s <= 0:
            raise ValueError(
                "teacher: timeout_s and health_every_s must be > 0, retries >= 0, request_samples >= 1"
            )
        self.pool = ReplicaPool(list(urls), window)
        self.name, self.timeout_s, self.retries = name, timeout_s, retries
        self.request_samples, self.health_every_s = request_samples, health_every_s
        self.token_env = token_env
        self.token = bearer_token(token, token_env)
        self._http = HttpClient(self.token, connections=0)
        try:
            self._info = run_on_background_loop(self._agreed_info())
        except BaseException:
            self.close()  # refused at start: no connection left open
            raise

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
        self._http.close()

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
        await self._check_down()  # replicas out of rotation rejoin once proven again (rate-limited)
        for attempt in range(self.retries + 1):
            if attempt:
                self.pool.retries += 1
            await backoff(attempt, BACKOFF_S, MAX_BACKOFF_S)
            replica = await self._next_replica(tried)
            if replica is None:
                raise TeacherUnavailable(
                    f"no teacher replica of '{self.name}' is left ({self.pool.describe_down()}); start "
                    "`odrl serve-teacher` with the run's teacher again where teacher.urls points, the run "
                    "continues from its last checkpoint with --resume"
                )
            tried.add(replica.url)
            replica.outstanding += len(x)
            replica.in_flight += 1
            started = time.perf_counter()
            try:
                v = await self._post(replica, body, tuple(x.shape))
            except TIMEOUTS:
                self.pool.fail(replica, f"no answer within teacher.timeout_s={self.timeout_s:g} s")
                continue
            except _Busy:  # the replica is fine, only busy or stopping: try again, elsewhere if possible
                continue
            except _Unproven as e:  # a new connection reached a server that is not the run's teacher
                self._keep_out(replica, e.problem, e.refused)
                continue
            except (*TRANSPORT_ERRORS, _ServerFault, AnswerTooLarge) as e:
                self.pool.fail(replica, f"{type(e).__name__}: {e}")
                continue
            finally:
                replica.outstanding -= len(x)
                replica.in_flight -= 1
                replica.seconds += time.perf_counter() - started
                self.pool.slot_freed.wake_all()
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
            if self.pool.candidates(tried):  # untried ones exist but are all busy: sleep until one frees
                await self.pool.slot_freed.wait(SLOT_WAIT_S)
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
        """The replica's answer to one request; over a new connection, only once the replica is
        proven to serve the run's teacher (else _Unproven)."""
        url, limit = f"{replica.url}/velocity/{self.name}", math.prod(shape) * 4 + ANSWER_ROOM
        answer = await self._http.post(url, body, self.timeout_s, max_bytes=limit)
        if answer.status in (429, 503):
            raise _Busy(f"HTTP {answer.status}")
        if answer.status >= 500 or answer.status == 408:
            raise _ServerFault(f"HTTP {answer.status}: {answer.body[:300].decode(errors='replace')}")
        if answer.status != 200:
            hint = f" ({self._token_hint()})" if answer.status in (401, 403) else ""
            text = answer.body[:300].decode(errors="replace")
            raise TeacherRequestRejected(
                f"teacher server {replica.url} answered {answer.status}: {text}{hint}"
            )
        if answer.new_connection:
            await self._prove(replica, self.timeout_s)
        try:
            return decode_velocity(answer.body, shape)
        except ValueError as e:
            raise _ServerFault(str(e)) from e

    async def _check_down(self) -> None:
        """Probe the replicas out of rotation whose last probe is old enough: one rejoins once its
        /info proves it serves the run's teacher."""

        async def probe(replica: Replica) -> None:
            replica.checked_at = time.monotonic()
            try:
                await self._prove(replica, HEALTH_TIMEOUT_S)
            except _Unproven as e:
                self._keep_out(replica, e.problem, e.refused)
                return
            replica.healthy, replica.logged = True, ""
            self.pool.slot_freed.wake_all()  # requests waiting for a slot may take the rejoined one

        await asyncio.gather(*(probe(r) for r in self.pool.due_for_check(self.health_every_s)))

    async def _prove(self, replica: Replica, timeout_s: float) -> None:
        """Return once `replica` describes the teacher agreed at start; else _Unproven says why."""
        try:
            info = await self._served_info(replica, timeout_s)
        except _InfoProblem as e:
            raise _Unproven(e.problem, refused=e.kind is not TeacherUnavailable) from e
        if info != self._info:
            raise _Unproven(f"serves another teacher than the run's ({_difference(info, self._info)})", True)

    def _keep_out(self, replica: Replica, problem: str, refused: bool) -> None:
        """Take `replica` out of rotation; a replica that answers but is refused is logged (once)."""
        self.pool.fail(replica, problem)
        if refused and replica.logged != problem:
            replica.logged = problem
            logger.warning(
                "odrl: teacher replica %s %s; it stays out of rotation until it serves the run's teacher "
                "(fingerprint %s) again",
                replica.url,
                problem,
                self._info.fingerprint,
            )

    async def _agreed_info(self) -> TeacherInfo:
        """Every replica's /info must serve this teacher and describe the same one."""
        seen: dict[str, TeacherInfo] = {}
        for replica in self.pool.replicas:
            try:
                seen[replica.url] = await self._served_info(replica, self.timeout_s)
            except _InfoProblem as e:
                start = f"; start `odrl serve-teacher {self.name}` there or fix teacher.urls"
                advice = start if e.kind is TeacherUnavailable else ""
                raise e.kind(f"teacher server {replica.url} {e.problem}{advice}") from e
        infos = set(seen.values())
        if len(infos) > 1:
            listing = "; ".join(f"{u}: {i.fingerprint}" for u, i in seen.items())
            raise TeacherServerMismatch(
                f"the teacher replicas serve different models (fingerprints {listing}); start every "
                "replica with the same teacher"
            )
        return infos.pop()

    async def _served_info(self, replica: Replica, timeout_s: float) -> TeacherInfo:
        """How `replica`'s /info describes teacher `name`, or _InfoProblem saying why it cannot."""
        try:
            answer = await self._http.get(f"{replica.url}/info", timeout_s)
        except (*TRANSPORT_ERRORS, *TIMEOUTS) as e:
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            raise _InfoProblem(TeacherUnavailable, f"does not answer /info ({reason})") from e
        except AnswerTooLarge as e:
            message = f"{e} at /info: is it an `odrl serve-teacher` server?"
            raise _InfoProblem(TeacherServerMismatch, message) from e
        status, body = answer.status, answer.body
        if status in (401, 403):
            raise _InfoProblem(TeacherRequestRejected, f"refused /info ({status}): {self._token_hint()}")
        try:
            data = loads_bounded(body, MAX_ANSWER_DEPTH, "its /info") if status == 200 else None
        except ValueError as e:
            raise _InfoProblem(
                TeacherServerMismatch, f"answered {e}: is it an `odrl serve-teacher` server?"
            ) from None
        if not isinstance(data, dict):
            raise _InfoProblem(
                TeacherServerMismatch,
                f"answered /info with {status} and no teacher description: is it an `odrl serve-teacher` "
                "server?",
            )
        return self._described(data)

    def _described(self, data: dict[str, Any]) -> TeacherInfo:
        """Teacher `name`'s description in a server's /info, or _InfoProblem."""
        served = data.get("teachers")
        if not isinstance(served, dict) or self.name not in served:
            others = sorted(served) if isinstance(served, dict) else []
            rewards = data.get("rewards") if not others else None
            kind = f"; it is a reward server (rewards {rewards})" if rewards else ""
            raise _InfoProblem(
                TeacherServerMismatch,
                f"does not serve '{self.name}'; it serves {others}{kind}: point teacher.urls at "
                f"`odrl serve-teacher {self.name}` servers",
            )
        try:
            return TeacherInfo.from_dict(served[self.name])
        except TeacherMismatch as e:
            raise _InfoProblem(TeacherServerMismatch, str(e)) from e

    def _token_hint(self) -> str:
        """What to do about a refused token."""
        if self.token is None:
            return (
                f"no token was sent: set {self.token_env} to the token the teacher server was started "
                "with (or teacher.token_env to the variable that holds it)"
            )
        return f"the token sent (from {self.token_env}) is not the teacher server's: set the server's token"


def _teacher_url(url: str) -> str:
    try:
        return server_base_url(url, kind="teacher")
    except ServerURLError as e:
        raise TeacherURLError(f"teacher.urls: {e}") from e


def _difference(got: TeacherInfo, want: TeacherInfo) -> str:
    """What differs between a replica's description and the run's teacher."""
    names = ("fingerprint", "latent_shape", "layout", "convention", "trained_parts")
    return "; ".join(
        f"{name} {getattr(got, name)} where the run's is {getattr(want, name)}"
        for name in names
        if getattr(got, name) != getattr(want, name)
    )


class _InfoProblem(Exception):
    """Why a replica's /info does not describe the teacher: `kind` is the public error it becomes."""

    def __init__(self, kind: type[TeacherServerError], problem: str) -> None:
        super().__init__(problem)
        self.kind, self.problem = kind, problem


class _Unproven(Exception):
    """A replica not proven to serve the run's teacher; refused: it answered, but not as the run's."""

    def __init__(self, problem: str, refused: bool) -> None:
        super().__init__(problem)
        self.problem, self.refused = problem, refused


class _Busy(Exception):
    """The replica answered 503 or 429: busy or stopping, not broken."""


class _ServerFault(Exception):
    """A replica-side failure worth another replica (5xx, 408/429, a malformed answer)."""
