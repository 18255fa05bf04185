"""The reward contract and the weighted combination the trainer uses.

A reward is any object with `score(media: MediaBatch, prompts: list[str])` (a plain method or an
`async def`) returning one finite score per sample: a float Tensor [B], or a `RewardOutput` that
also carries named components [B] for logging. Register it with
`@omni_diffusion_rl.registry.rewards.register("name")` or the `omni_diffusion_rl.rewards` entry points.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
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


@runtime_checkable
class Reward(Protocol):
    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor | RewardOutput: ...


def _run_coroutine(coro: Any) -> Any:
    """Run a coroutine to completion from sync code, also when this thread already runs an event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1) as pool:  # e.g. inside Jupyter: run it on a loop of its own thread
        return pool.submit(asyncio.run, coro).result()


def call_reward(reward: Reward, media: MediaBatch, prompts: list[str]) -> object:
    """reward.score(media, prompts), awaited when it is an `async def`."""
    out = reward.score(media, prompts)
    return _run_coroutine(out) if inspect.isawaitable(out) else out


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
    as_float = {k: v.detach().float().cpu() for k, v in components.items()}
    return RewardOutput(scores.detach().float().cpu(), as_float)


def checked_scores(name: str, scores: object, batch_size: int) -> torch.Tensor:
    """The scores as a float tensor [B], or a RewardError naming what is wrong (incl. NaN/inf)."""
    out = checked_output(name, scores, batch_size).scores
    bad = ~torch.isfinite(out)
    if bad.any():
        raise RewardError(
            f"reward '{name}' returned non-finite scores (NaN/inf) for samples "
            f"{bad.nonzero().flatten().tolist()}"
        )
    return out


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
        self.retries = retries
        self.max_failed_fraction = max_failed_fraction
        self._executor: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def from_registry(
        cls, weights: dict[str, float], options: dict[str, dict[str, Any]] | None = None, **kwargs: Any
    ) -> WeightedReward:
        """Each named reward created from the registry with its keyword arguments from `options`."""
        options = options or {}
        components = {name: reward_registry.create(name, **options.get(name, {})) for name in weights}
        return cls(components, weights, **kwargs)

    @classmethod
    def from_config(cls, cfg: Any) -> WeightedReward:
        """From a RewardConfig: rewards the server at `cfg.url` serves are scored there, the rest here."""
        served: list[str] = []
        client_options: dict[str, Any] = {}
        if cfg.url:
            from .serving.client import RemoteReward

            client_options = {
                "token": os.environ.get(cfg.token_env) or None,
                "timeout_s": cfg.timeout_s,
                "retries": cfg.request_retries,
            }
            probe = RemoteReward(cfg.url, "", **client_options)
            try:
                served = probe.info().get("rewards", [])
            finally:
                probe.close()
        components: dict[str, Reward] = {}
        for name in cfg.weights:
            if name in served:
                if name in cfg.options:
                    raise RewardError(
                        f"reward.options.{name}: '{name}' is scored by the server at {cfg.url}; give its "
                        "options to `odrl serve-reward` there instead"
                    )
                components[name] = RemoteReward(cfg.url, name, **client_options)
            else:
                components[name] = reward_registry.create(name, **cfg.options.get(name, {}))
        if served:
            local = sorted(set(cfg.weights) - set(served))
            logger.info(
                "rewards scored by %s: %s; here: %s", cfg.url, sorted(set(cfg.weights) & set(served)), local
            )
        return cls(components, cfg.weights, retries=cfg.retries, max_failed_fraction=cfg.max_failed_fraction)

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
    def __call__(self, media: MediaBatch, prompts: list[str]) -> ScoreResult:
        """Every reward on the batch: combined scores, each component, and the samples that failed."""
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
            parts.update({f"{name}/{k}": v for k, v in out.components.items()})
            total += self.weights[name] * out.scores
        if failures:
            total[list(failures)] = float("nan")
            for v in parts.values():
                v[list(failures)] = float("nan")
        if len(failures) > self.max_failed_fraction * len(media):
            reasons = sorted(set(failures.values()))
            raise RewardError(
                f"{len(failures)} of {len(media)} samples could not be scored (more than "
                f"reward.max_failed_fraction={self.max_failed_fraction}): " + "; ".join(reasons[:5])
            )
        return ScoreResult(total, parts, failures)

    def submit(self, media: MediaBatch, prompts: list[str]) -> Future[ScoreResult]:
        """Score on a background thread (one batch at a time, in order) while the caller goes on."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="reward")
            return self._executor.submit(self.__call__, media, prompts)

    def close(self) -> None:
        """Stop the background thread and close components that hold connections or processes."""
        if self._executor is not None:
            self._executor.shutdown(wait=True)
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
