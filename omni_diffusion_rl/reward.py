"""The reward contract and the weighted combination the trainer uses.

A reward is any object with `score(media: MediaBatch, prompts: list[str])` (a plain method or an
`async def`) returning one finite score per sample: a float Tensor [B], or a `RewardOutput` that
also carries named components [B] for logging. Register it with
`@omni_diffusion_rl.registry.rewards.register("name")` or the `omni_diffusion_rl.rewards` entry points.
A run's combined reward is built from its config by `reward_factory.reward_from_config`.
A reward may declare `input_limits` (InputLimits), the largest sample it is meant for: a reward
server refuses larger requests before the reward sees them. It may declare `modality`, what it
judges ("video", "audio", or "audio_video" for synchrony): algorithm.credit=per_modality routes
each modality's advantage from the rewards that judge it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from .media import MediaBatch
from .registry import rewards as reward_registry

logger = logging.getLogger(__name__)


class RewardError(RuntimeError):
    """A reward is broken or unreachable (a run stops); a sample it cannot score is dropped instead."""


@dataclass
class RewardOutput:
    """Scores [B] and optional named components [B] (logged as reward/<reward>/<component>)."""

    scores: torch.Tensor
    components: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass(frozen=True)
class InputLimits:
    """The largest sample a reward is meant for, declared as the reward's attribute `input_limits`.

    A reward server refuses (413, naming the limit and what it got) frames larger than
    `frame_height` x `frame_width`, and a request holding more video pixels (B x F x H x W) or audio
    values (B x C x S) than `max_batch` such samples, before the reward sees it. In-process scoring
    does not check: a run's own clips are trusted. A reward that declares none gets
    DEFAULT_INPUT_LIMITS.
    """

    frames: int  # video frames of the largest sample
    frame_height: int
    frame_width: int
    audio_samples: int  # audio values of the largest sample: channels x samples per channel
    meant_for: str = ""  # what these are, quoted in the server's refusals

    def __post_init__(self) -> None:
        sizes = (self.frames, self.frame_height, self.frame_width, self.audio_samples)
        if not all(isinstance(v, int) and v >= 1 for v in sizes):
            raise ValueError(f"input limits must be whole numbers >= 1; got {self}")

    @property
    def pixels(self) -> int:
        """Video pixels (F x H x W) of the largest sample."""
        return self.frames * self.frame_height * self.frame_width

    def per_request(self, max_batch: int) -> dict[str, int | str]:
        """These limits and the request budgets they give at `max_batch` samples (the server's /info)."""
        return {
            "frames": self.frames,
            "frame_height": self.frame_height,
            "frame_width": self.frame_width,
            "audio_samples": self.audio_samples,
            "request_pixels": max_batch * self.pixels,
            "request_audio_samples": max_batch * self.audio_samples,
            "meant_for": self.meant_for,
        }


DEFAULT_INPUT_LIMITS = InputLimits(
    frames=2048,
    frame_height=4096,
    frame_width=4096,
    audio_samples=2 * 48_000 * 1200,
    meant_for="the default for a reward that declares no input_limits: 2048 frames of 4096 x 4096, "
    "20 minutes of stereo 48 kHz audio",
)


def samples_by_prompt(prompts: list[str]) -> list[list[int]]:
    """The indices of each prompt's samples in a batch, prompts in order of first appearance: what a
    reward comparing a prompt's samples with each other (a diversity term) scores together."""
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    return list(groups.values())


def declared_modality(reward: object) -> str | None:
    """What a reward says it judges (its `modality` attribute), or None when it says nothing."""
    value = getattr(reward, "modality", None)
    return value if isinstance(value, str) else None


def input_limits(reward: object) -> InputLimits:
    """The limits `reward` declares (its `input_limits`), or DEFAULT_INPUT_LIMITS."""
    declared = getattr(reward, "input_limits", None)
    if declared is None:
        return DEFAULT_INPUT_LIMITS
    if not isinstance(declared, InputLimits):
        raise TypeError(
            f"{type(reward).__name__}.input_limits is a {type(declared).__name__}; declare an "
            "omni_diffusion_rl.reward.InputLimits, or none for the defaults"
        )
    return declared


@runtime_checkable
class Reward(Protocol):
    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor | RewardOutput: ...


_LOOP: asyncio.AbstractEventLoop | None = None
_LOOP_THREAD: threading.Thread | None = None
_LOOP_LOCK = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """One long-lived asyncio loop on a daemon thread per process: async rewards and reward-server
    clients run there, so objects they keep (sessions, clients) stay on one loop across calls."""
    global _LOOP, _LOOP_THREAD
    with _LOOP_LOCK:
        if _LOOP is None or _LOOP.is_closed():
            _LOOP = asyncio.new_event_loop()
            _LOOP_THREAD = threading.Thread(target=_LOOP.run_forever, name="odrl-async", daemon=True)
            _LOOP_THREAD.start()
        return _LOOP


def run_on_background_loop(coro: Any) -> Any:
    """Run a coroutine on the background loop and wait for it (from any thread but that loop's)."""
    loop = background_loop()
    if threading.current_thread() is _LOOP_THREAD:
        coro.close()
        raise RuntimeError("a reward called synchronously from the background loop itself would deadlock")
    return asyncio.run_coroutine_threadsafe(coro, loop).result()


def call_reward(reward: Reward, media: MediaBatch, prompts: list[str]) -> object:
    """reward.score(media, prompts), awaited when it is an `async def`."""
    out = reward.score(media, prompts)
    return run_on_background_loop(_awaited(out)) if inspect.isawaitable(out) else out


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


def checked_output(name: str, out: object, batch_size: int) -> RewardOutput:
    """The reward's answer as a RewardOutput of float CPU tensors [B] (NaN kept: the caller handles it),
    or a RewardError when its type or shape breaks the contract."""
    scores, components = (out.scores, out.components) if isinstance(out, RewardOutput) else (out, {})
    for label, t in [(name, scores), *((f"{name}/{k}", v) for k, v in components.items())]:
        if not isinstance(t, torch.Tensor):
            raise RewardError(
                f"reward '{label}' returned {type(t).__name__}; it must return a torch.Tensor [B] "
                "or a RewardOutput"
            )
        if t.shape != (batch_size,):
            raise RewardError(
                f"reward '{label}' returned shape {tuple(t.shape)} for a batch of {batch_size}; "
                f"expected ({batch_size},)"
            )
    # Copies: failed samples are overwritten with NaN later, and the reward may keep its tensors.
    as_float = {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in components.items()}
    return RewardOutput(scores.detach().to("cpu", torch.float32, copy=True), as_float)


@dataclass
class ScoreResult:
    """Scores of one batch: `total` [B] and `parts` (each reward and its components) [B], NaN where a
    sample could not be scored; `failures` maps each such sample to the reason."""

    total: torch.Tensor
    parts: dict[str, torch.Tensor]
    failures: dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> torch.Tensor:
        """[B] bool: the samples that were scored."""
        mask = torch.ones(len(self.total), dtype=torch.bool)
        mask[list(self.failures)] = False
        return mask


class WeightedReward:
    """sum_i w_i * reward_i / sum_i w_i, with every component kept for logging.

    Failure rules: a reward that breaks the contract (wrong type or shape) or raises RewardError
    stops the run. A reward that raises anything else is retried `retries` times on the batch, then
    asked about each sample alone; non-finite scores are retried on their samples. A sample still
    unscored is dropped with its reason. More than `max_failed_fraction` of a batch dropped is a
    RewardError: a broken reward must not quietly eat the data.
    """

    def __init__(
        self,
        components: dict[str, Reward],
        weights: dict[str, float],
        retries: int = 1,
        max_failed_fraction: float = 0.25,
        modalities: dict[str, str] | None = None,
    ) -> None:
        if set(components) != set(weights):
            raise ValueError(
                f"components {sorted(components)} and weights {sorted(weights)} must name the same rewards"
            )
        total = sum(weights.values())
        if total <= 0:
            raise ValueError("reward weights must sum to a positive number")
        if retries < 0 or not 0 <= max_failed_fraction <= 1:
            raise ValueError(f"retries ({retries}) must be >= 0 and max_failed_fraction in [0, 1]")
        self.components = components
        self.weights = {k: w / total for k, w in weights.items()}
        self.modality_overrides = dict(modalities or {})  # checked where they are used (credit)
        self.retries = retries
        self.max_failed_fraction = max_failed_fraction
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._component_names: dict[str, set[str]] = {name: set() for name in components}

    @property
    def modalities(self) -> dict[str, str | None]:
        """Each reward's judged modality: the override given (reward.modalities, or a server's
        declaration), else the reward's own `modality`; None where neither says."""
        return {
            name: self.modality_overrides.get(name) or declared_modality(reward)
            for name, reward in self.components.items()
        }

    @classmethod
    def from_registry(
        cls, weights: dict[str, float], options: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> WeightedReward:
        """Each named reward created from the registry with its keyword arguments from `options`."""
        options = options or {}
        components = {name: reward_registry.create(name, **options.get(name, {})) for name in weights}
        return cls(components, weights, **kwargs)

    # ------------------------------------------------------------------ one component
    def _attempt(self, name: str, reward: Reward, media: MediaBatch, prompts: list[str]) -> RewardOutput:
        try:
            out = call_reward(reward, media, prompts)
        except RewardError:
            raise
        except Exception as e:
            raise _SampleFailure(f"{type(e).__name__}: {e}") from e
        return checked_output(name, out, len(media))

    def _score_component(
        self, name: str, reward: Reward, media: MediaBatch, prompts: list[str]
    ) -> tuple[RewardOutput, dict[int, str]]:
        """One reward on the batch, with retries; NaN and a reason for each sample it could not score."""
        n = len(media)
        out: RewardOutput | None = None
        for attempt in range(self.retries + 1):
            try:
                out = self._attempt(name, reward, media, prompts)
                break
            except _SampleFailure as e:
                logger.warning(
                    "reward '%s' failed on a batch of %d (attempt %d): %s", name, n, attempt + 1, e
                )
        failures: dict[int, str] = {}
        if out is None:  # the batch keeps failing: find the samples that do
            parts = []
            for i in range(n):
                try:
                    parts.append(self._attempt(name, reward, media.select([i]), [prompts[i]]))
                except _SampleFailure as e:
                    parts.append(_nan_output(1))
                    failures[i] = f"{name}: {e}"
            out = _concat_outputs(parts)
        for attempt in range(self.retries + 1):
            bad = [i for i in (~torch.isfinite(out.scores)).nonzero().flatten().tolist() if i not in failures]
            if not bad:
                break
            if attempt == self.retries:
                failures.update(dict.fromkeys(bad, f"{name}: non-finite score (NaN/inf)"))
                break
            try:
                again = self._attempt(name, reward, media.select(bad), [prompts[i] for i in bad])
            except _SampleFailure:
                continue
            out.scores[bad] = again.scores
            for k, v in again.components.items():
                if k in out.components:
                    out.components[k][bad] = v
        return out, failures

    # ------------------------------------------------------------------ the batch
    def __call__(self, media: MediaBatch, prompts: list[str], check: bool = True) -> ScoreResult:
        """Every reward on the batch: combined scores, each component, and the samples that failed.

        check: apply max_failed_fraction to this batch (a trainer checks whole steps instead)."""
        if len(prompts) != len(media):
            raise RewardError(f"{len(prompts)} prompts for {len(media)} media samples")
        parts: dict[str, torch.Tensor] = {}
        failures: dict[int, str] = {}
        total = torch.zeros(len(media))
        for name, reward in self.components.items():
            out, failed = self._score_component(name, reward, media, prompts)
            for i, reason in failed.items():
                failures.setdefault(i, reason)
            parts[name] = out.scores
            seen = self._component_names[name]
            seen.update(out.components)
            nan = torch.full((len(media),), float("nan"))
            parts.update({f"{name}/{k}": out.components.get(k, nan.clone()) for k in sorted(seen)})
            total += self.weights[name] * out.scores
        if failures:
            total[list(failures)] = float("nan")
            for v in parts.values():
                v[list(failures)] = float("nan")
        if check:
            self.check_failures(len(failures), len(media), list(failures.values()))
        return ScoreResult(total, parts, failures)

    def check_failures(self, failed: int, total: int, reasons: list[str]) -> None:
        """RewardError when more than max_failed_fraction of `total` samples failed."""
        if failed > self.max_failed_fraction * total:
            raise RewardError(
                f"{failed} of {total} samples could not be scored (more than reward.max_failed_fraction="
                f"{self.max_failed_fraction}): " + "; ".join(sorted(set(reasons))[:5])
            )

    def submit(self, media: MediaBatch, prompts: list[str]) -> Future[ScoreResult]:
        """Score on a background thread (one batch at a time, in order) while the caller goes on; the
        failure threshold is left to the caller, which sees the whole step."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward")
            return self._executor.submit(self._score_quietly, media, prompts)

    def _score_quietly(self, media: MediaBatch, prompts: list[str]) -> ScoreResult:
        with torch.no_grad():  # grad mode is per thread: the caller's no_grad does not reach this one
            return self(media, prompts, check=False)

    def close(self) -> None:
        """Stop the background thread (queued batches are dropped) and close components that hold
        connections or processes."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        for reward in self.components.values():
            close = getattr(reward, "close", None)
            if callable(close):
                close()


class _SampleFailure(Exception):
    """A reward raised on a batch: may be one bad sample, so it is retried and isolated."""


def _nan_output(n: int) -> RewardOutput:
    return RewardOutput(torch.full((n,), float("nan")))


def _concat_outputs(parts: list[RewardOutput]) -> RewardOutput:
    """Per-sample outputs joined into one; a component missing from a failed sample is NaN there."""
    names = {k for p in parts for k in p.components}
    components = {
        k: torch.cat([p.components.get(k, torch.full((len(p.scores),), float("nan"))) for p in parts])
        for k in sorted(names)
    }
    return RewardOutput(torch.cat([p.scores for p in parts]), components)
