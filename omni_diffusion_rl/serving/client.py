"""A reward scored by a reward server: the same contract as a local reward, plus retries and timeouts.

Requests run on the process's background event loop (kept alive so connections are reused). A batch
is cut into requests that fit the server's size and batch limits and sent concurrently. A request
the server did not answer (down, timed out, 408/429/5xx) is retried with exponential backoff; after
the last retry a RewardServerError names the server, the attempts and the last error. Another 4xx
about the batch itself (e.g. NaN audio) is not retried here: it is raised as RequestRejected, and
the weighted reward's failure rules (retry, score each sample alone, drop with the reason) apply.
An answer larger than MAX_ANSWER_BYTES (http_client.py) is a RewardServerError, not read to its end.

The url is the server's address only, scheme://host:port (as `odrl serve-reward` prints it): the
client adds /info and /score/NAME itself, so a url with a path, query or fragment is refused when the
client is made (ServerURLError) rather than failing later with a 404 or 405.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import torch

from ..bounded_json import loads_bounded
from ..media import MediaBatch
from ..reward import RewardError, RewardOutput, run_on_background_loop
from .http_client import MAX_ANSWER_DEPTH, AnswerTooLarge, GaveUp, HttpClient, bearer_token, with_retries
from .wire import encode_media, scores_from_json

T = TypeVar("T")


class RewardServerError(RewardError):
    """The reward server could not be used (unreachable after retries, unauthorised, broken reward)."""


class ServerURLError(RewardServerError, ValueError):
    """A reward server url that cannot work (not http(s)://host:port); raised when the client is made."""


class RequestRejected(ValueError):
    """The server refused this batch (4xx) and said why; retrying the same batch cannot help."""


RETRYABLE_STATUS = (408, 429)  # besides 5xx: a timeout or rate limit on the way, worth another try
HEADER_ROOM = 64 * 1024  # safetensors header besides the prompts (tensor offsets, fps, sample rate)
MAX_HEADER_BYTES = 1 << 20  # the server's limit on the safetensors header, which carries the prompts


class RemoteReward:
    """Scores with reward `name` on the server at `url` (started with `odrl serve-reward`).

    token: bearer token (default: the ODRL_REWARD_TOKEN environment variable, if set).
    timeout_s: per request; retries: extra attempts after a failed request, waiting backoff_s * 2^k
    (at most max_backoff_s) between them; max_concurrency: requests in flight per batch;
    max_samples_per_request: cut batches into requests of at most this many samples (0: as the
    server's size limit allows). url: scheme://host:port only, e.g. http://127.0.0.1:8400 (a trailing
    slash is fine; a path is refused). name may be "" for a client that only asks /info; wanted: the
    reward names the caller means to score there, named in errors (default: [name]).
    """

    def __init__(
        self,
        url: str,
        name: str,
        token: str | None = None,
        timeout_s: float = 120.0,
        retries: int = 6,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_concurrency: int = 8,
        max_samples_per_request: int = 0,
        dtype: torch.dtype = torch.float32,
        wanted: Sequence[str] = (),
    ) -> None:
        if (
            timeout_s <= 0
            or retries < 0
            or backoff_s < 0
            or max_concurrency < 1
            or max_samples_per_request < 0
        ):
            raise ValueError(
                "timeout_s must be > 0, retries/backoff_s/max_samples_per_request >= 0, max_concurrency >= 1"
            )
        self.url = server_base_url(url)
        self.name = name
        self.wanted = list(wanted) or ([name] if name else [])
        self.token = bearer_token(token, "ODRL_REWARD_TOKEN")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_concurrency = max_concurrency
        self.max_samples_per_request = max_samples_per_request
        self.dtype = dtype
        self._info: dict[str, Any] | None = None
        self._http = HttpClient(self.token)

    # ------------------------------------------------------------------ sync API (the Reward contract)
    def score(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        return self._run(self.score_async(media, prompts))

    def info(self) -> dict[str, Any]:
        """The server's /info (rewards served, limits, batching statistics)."""
        return self._run(self._get_json("/info"))

    def close(self) -> None:
        """Close this client's connections (it reconnects if used again)."""
        self._http.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return run_on_background_loop(coro)

    # ------------------------------------------------------------------ async API
    async def score_async(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        """Scores [B] (NaN where the server's reward gave a non-finite value) and components."""
        if len(prompts) != len(media):
            raise ValueError(f"{len(prompts)} prompts for {len(media)} media samples")
        if self._info is None:
            self._info = await self._get_json("/info")
            if self.name not in self._info.get("rewards", []):
                raise RewardServerError(
                    f"the reward server at {self.url} does not serve '{self.name}'; it serves "
                    f"{self._info.get('rewards')}"
                )
        chunk = self._samples_per_request(media, prompts)
        limit = asyncio.Semaphore(self.max_concurrency)

        async def one(start: int) -> RewardOutput:
            async with limit:
                part = media.select(slice(start, start + chunk))
                return await self._score_request(part, prompts[start : start + chunk])

        tasks = [asyncio.ensure_future(one(s)) for s in range(0, len(media), chunk)]
        try:
            parts = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:  # one request failed: do not leave the others running
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        names = parts[0].components.keys()
        return RewardOutput(
            torch.cat([p.scores for p in parts]),
            {k: torch.cat([p.components[k] for p in parts]) for k in names},
        )

    def _samples_per_request(self, media: MediaBatch, prompts: list[str]) -> int:
        """The most samples per request within the server's byte limit, its header limit (the prompts
        travel in the header) and its max batch."""
        info = self._info or {}
        tensor_bytes = sum(
            t[0].numel() * self.dtype.itemsize for t in (media.video, media.audio) if t is not None and len(t)
        )
        prompt_bytes = max((len(json.dumps(p)) + 2 for p in prompts), default=1)
        limits = [len(media), self.max_samples_per_request or len(media)]
        limits.append(max(1, (MAX_HEADER_BYTES - HEADER_ROOM) // prompt_bytes))
        if info.get("max_request_bytes"):
            room = int(info["max_request_bytes"]) - HEADER_ROOM
            limits.append(max(1, room // max(1, tensor_bytes + prompt_bytes)))
        if info.get("max_batch"):
            limits.append(int(info["max_batch"]))
        return max(1, min(limits))

    async def _get_json(self, path: str) -> dict[str, Any]:
        async def attempt() -> dict[str, Any]:
            answer = await self._http.get(self.url + path, self.timeout_s)
            self._raise_for_status(answer.status, answer.body)
            return _json(answer.body)

        return await self._with_retries(attempt, f"GET {path}")

    async def _score_request(self, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        body = encode_media(media, prompts, self.dtype)

        async def attempt() -> RewardOutput:
            answer = await self._http.post(f"{self.url}/score/{self.name}", body, self.timeout_s)
            self._raise_for_status(answer.status, answer.body)
            data = _json(answer.body)
            try:
                what = f"reward '{self.name}' at {self.url}"
                scores = scores_from_json(data.get("scores"), len(media), what)
                components = {
                    k: scores_from_json(v, len(media), f"{what}, component '{k}'")
                    for k, v in dict(data.get("components") or {}).items()
                }
            except ValueError as e:
                raise RewardServerError(f"malformed answer: {e}") from e
            return RewardOutput(scores, components)

        return await self._with_retries(attempt, f"POST /score/{self.name}")

    def _raise_for_status(self, status: int, body: bytes) -> None:
        if status == 200:
            return
        message = _json(body).get("error") if body[:1] == b"{" else body[:300].decode(errors="replace")
        kind = _json(body).get("kind") if body[:1] == b"{" else None
        where = f"reward server {self.url}{self._for()}"
        if status in (401, 403, 404, 413) or kind == "reward_broken":
            hint = " (set the token in ODRL_REWARD_TOKEN or reward.token_env)" if status in (401, 403) else ""
            raise RewardServerError(f"{where} answered {status}: {message}{hint}")
        if 400 <= status < 500 and status not in RETRYABLE_STATUS:
            raise RequestRejected(f"{where} answered {status}: {message}")
        raise _Retryable(f"HTTP {status}: {message}")

    async def _with_retries(self, attempt: Callable[[], Awaitable[T]], what: str) -> T:
        """attempt()'s result, retried as the class says; a RewardServerError once it gives up."""
        try:
            return await with_retries(
                attempt,
                self.retries,
                self.backoff_s,
                self.max_backoff_s,
                f"no answer within timeout_s={self.timeout_s:g} s",
                retry_on=(_Retryable,),
            )
        except AnswerTooLarge as e:
            raise RewardServerError(f"reward server {self.url}{self._for()}: {what} {e}") from e
        except GaveUp as e:
            command = " ".join(["odrl serve-reward", *(self.wanted or ["NAME ..."])])
            attempts = f"{e.attempts} time{'s' if self.retries else ''}"
            raise RewardServerError(
                f"reward server {self.url}{self._for()}: {what} failed {attempts} over "
                f"{e.seconds:.1f} s; last error: {e.last}. Is `{command}` running there? Start "
                "it, or point reward.url at where it runs (reward.request_retries and reward.timeout_s set "
                "the patience)"
            ) from None

    def _for(self) -> str:
        """' (for reward 'a')' / ' (for rewards 'a', 'b')' / '' : who wanted this server, for errors."""
        if not self.wanted:
            return ""
        plural = "s" if len(self.wanted) > 1 else ""
        return f" (for reward{plural} {', '.join(repr(n) for n in self.wanted)})"


SERVER_KINDS = {
    "reward": ("serve-reward", 8400, "/score/NAME"),
    "teacher": ("serve-teacher", 8500, "/velocity/NAME"),
}


def server_base_url(url: str, kind: str = "reward") -> str:
    """`url` as scheme://host[:port] without a trailing slash, or a ServerURLError saying what to give;
    kind: which server it should be (reward or teacher), named in the errors."""
    command, port, path = SERVER_KINDS[kind]
    example = f"give only scheme://host:port, e.g. http://127.0.0.1:{port} (as `odrl {command}` prints it)"
    what = f"{kind} server url '{url}'"
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        raise ServerURLError(f"{what} is not a valid url ({e}); {example}") from e
    if parts.scheme not in ("http", "https"):
        raise ServerURLError(f"{what} must start with http:// or https://; {example}")
    if not parts.hostname:
        raise ServerURLError(f"{what} has no host; {example}")
    if parts.path not in ("", "/") or parts.query or parts.fragment or url.endswith(("?", "#")):
        raise ServerURLError(
            f"{what} has a path, query or fragment; {example}. The client adds /info and {path} itself"
        )
    return f"{parts.scheme}://{parts.netloc}"


class _Retryable(Exception):
    """A server-side failure worth another attempt (5xx)."""


def _json(body: bytes) -> dict[str, Any]:
    try:
        data = loads_bounded(body, MAX_ANSWER_DEPTH, "the reward server's answer")
    except ValueError as e:
        raise RewardServerError(f"{e}: {body[:200]!r}") from None
    if not isinstance(data, dict):
        raise RewardServerError(f"the reward server answered JSON that is not an object: {str(data)[:200]}")
    return data
