"""Held-out evaluation: the training reward and metrics that are never trained on.

A reward that rises is not evidence that the model got better: a policy finds the cheapest way to
its reward. So every evaluation scores the held-out samples twice, with the training reward and
with `eval.metrics`, registered scorers that training never sees (the tiny world's
`tiny_world_judge`; for real models another reward model, e.g. train on CLAP and evaluate with
ImageBind). A scorer that fails on a sample leaves that sample out of its mean and counts it
(`<metric>/failed_samples`); it is never scored 0.

The held-out set is fixed whatever the seed: sample i has prompt prompts[i % P] and noise row i of
`heldout_noise` (P: all the prompts, or fewer when there are not two samples for each). Samples of
one prompt form a group (diversity is measured within it); with several processes each takes
whole groups.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..media import MediaBatch
from ..reward import RewardError, ScoreResult, WeightedReward

logger = logging.getLogger(__name__)

_HELDOUT_SEED = 20_251_201


def heldout_noise(num_samples: int, latent_shape: tuple[int, ...]) -> torch.Tensor:
    """The fixed noise of the held-out set [num_samples, *latent_shape], independent of the run's seed."""
    key = hashlib.sha256(f"heldout:{_HELDOUT_SEED}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") >> 1)
    return torch.randn((num_samples, *latent_shape), generator=gen)


def prompts_used(prompts: list[str], num_samples: int) -> int:
    """How many of the held-out prompts an evaluation of `num_samples` uses: all of them, unless that
    would leave a prompt with a single sample (per-prompt measures such as diversity need two)."""
    return max(1, min(len(prompts), num_samples // 2))


def heldout_prompts(prompts: list[str], num_samples: int) -> list[str]:
    """The prompt of each held-out sample: prompts[i % P] (P = `prompts_used`), so every prompt used
    gets num_samples / P samples."""
    used = prompts_used(prompts, num_samples)
    return [prompts[i % used] for i in range(num_samples)]


def samples_of_rank(prompts: list[str], num_samples: int, rank: int, world_size: int) -> list[int]:
    """Indices of the held-out samples that process `rank` generates: whole prompt groups."""
    return [i for group in prompt_groups(prompts, num_samples)[rank::world_size] for i in group]


@dataclass
class MetricScorer:
    """One eval metric: its scorer behind the reward failure rules (retries, per-sample isolation)."""

    name: str
    scorer: Any
    headline: str
    combined: WeightedReward = field(init=False)

    def __post_init__(self) -> None:
        # max_failed_fraction=1: an evaluation counts failures, it never stops the run for them.
        self.combined = WeightedReward({self.name: self.scorer}, {self.name: 1.0}, max_failed_fraction=1.0)

    def __call__(self, media: MediaBatch, prompts: list[str]) -> ScoreResult:
        """The metric on a batch; a scorer that breaks the reward contract fails the whole batch
        (NaN, with the reason) instead of stopping the run it only reports on."""
        try:
            return self.combined(media, prompts, check=False)
        except RewardError as e:
            logger.error("eval metric '%s' failed on a batch of %d: %s", self.name, len(media), e)
            nan = torch.full((len(media),), math.nan)
            return ScoreResult(nan, {self.name: nan.clone()}, dict.fromkeys(range(len(media)), str(e)))

    def close(self) -> None:
        self.combined.close()


def build_metrics(names: list[str], options: dict[str, dict[str, Any]] | None = None) -> list[MetricScorer]:
    """Each named scorer created from the reward registry with its keyword arguments."""
    from ..config import ConfigError
    from ..registry import rewards as registry

    options = options or {}
    metrics: list[MetricScorer] = []
    for name in names:
        try:
            scorer = registry.create(name, **options.get(name, {}))
        except (TypeError, ValueError, OSError) as e:
            raise ConfigError(
                f"eval.metrics: '{name}' could not be created with eval.options.{name}="
                f"{options.get(name, {})} ({type(e).__name__}: {e})"
            ) from e
        headline = str(getattr(scorer, "headline", name))
        taken = {m.headline for m in metrics} | {m.name for m in metrics}
        if headline in taken:
            raise ConfigError(
                f"eval.metrics: '{name}' reports '{headline}', which another metric reports too"
            )
        metrics.append(MetricScorer(name, scorer, headline))
    return metrics


def score_heldout(
    media: MediaBatch,
    prompts: list[str],
    reward: WeightedReward | None,
    metrics: list[MetricScorer],
    reasons: list[str] | None = None,
    sample_failures: dict[int, str] | None = None,
) -> dict[str, torch.Tensor]:
    """Per-sample columns [B] (NaN where a sample could not be scored): `reward`, `reward/<part>`,
    `<metric>` and `<metric>/<component>` for every eval metric. The reasons of failed samples are
    appended to `reasons`, and put by sample index into `sample_failures`, when given."""
    columns: dict[str, torch.Tensor] = {}
    failures: dict[int, str] = {}
    if reward is not None:
        scored = reward(media, prompts, check=False)
        columns["reward"] = scored.total
        columns.update({f"reward/{k}": v for k, v in scored.parts.items()})
        failures.update(scored.failures)
    for metric in metrics:
        scored = metric(media, prompts)
        columns.update(scored.parts)  # '<metric>' and '<metric>/<component>'
        failures.update(scored.failures)
    if reasons is not None:
        reasons.extend(sorted(set(failures.values())))
    if sample_failures is not None:
        sample_failures.update(failures)
    return columns


def summarize(columns: dict[str, torch.Tensor], metrics: list[MetricScorer]) -> dict[str, float]:
    """Means over the samples each column could score, and `<metric>/failed_samples` per metric."""
    out: dict[str, float] = {}
    for name, values in columns.items():
        finite = values[values.isfinite()]
        out[name] = float(finite.mean()) if len(finite) else math.nan
    for metric in metrics:
        if metric.name in columns:
            out[f"{metric.name}/failed_samples"] = float(columns[metric.name].isnan().sum())
    if "reward" in columns:
        out["reward/failed_samples"] = float(columns["reward"].isnan().sum())
    return out


def check_scored(summary: dict[str, float], what: str, reasons: list[str] | None = None) -> None:
    """RewardError when the training reward scored no held-out sample at all."""
    if "reward" in summary and math.isnan(summary["reward"]):
        why = f": {'; '.join(sorted(set(reasons))[:5])}" if reasons else ""
        raise RewardError(f"no sample of {what} could be scored by the training reward{why}")


def before_after_summary(
    before: dict[str, float], after: dict[str, float], metrics: list[MetricScorer]
) -> dict[str, Any]:
    """A run's held-out results, most telling first: each eval metric's headline before and after
    (`heldout_all_correct_before`), its components (the tiny world's attributes and health signs),
    then the training reward and its parts."""
    out: dict[str, Any] = {}
    for metric in metrics:
        if metric.headline == metric.name:
            continue  # reported as 'score' among its components below
        for when, values in (("before", before), ("after", after)):
            out[f"heldout_{metric.headline}_{when}"] = _rounded(values.get(metric.name, math.nan))
    for metric in metrics:
        prefix = f"{metric.name}/"
        for when, values in (("before", before), ("after", after)):
            parts = {k[len(prefix) :]: _rounded(v) for k, v in values.items() if k.startswith(prefix)}
            if metric.headline == metric.name:
                parts = {"score": _rounded(values.get(metric.name, math.nan)), **parts}
            out[f"heldout_{metric.name}_{when}"] = parts
    for when, values in (("before", before), ("after", after)):  # an answering policy's accuracy
        accuracy = {
            k[len("accuracy/") :]: _rounded(v) for k, v in values.items() if k.startswith("accuracy/")
        }
        if accuracy:
            out[f"heldout_accuracy_{when}"] = accuracy
    reward_before, reward_after = before.get("reward", math.nan), after.get("reward", math.nan)
    out["heldout_reward_before"] = _rounded(reward_before)
    out["heldout_reward_after"] = _rounded(reward_after)
    out["heldout_gain"] = _rounded(reward_after - reward_before)
    for when, values in (("before", before), ("after", after)):
        out[f"components_{when}"] = {
            k[len("reward/") :]: _rounded(v)
            for k, v in values.items()
            if k.startswith("reward/") and k != "reward/failed_samples"
        }
    return out


def _rounded(value: float) -> float | None:
    return None if not math.isfinite(value) else round(value, 4)


def json_safe(results: Any) -> Any:
    """NaN and infinities as None (JSON null) throughout nested dicts."""
    if isinstance(results, dict):
        return {k: json_safe(v) for k, v in results.items()}
    if isinstance(results, float) and not math.isfinite(results):
        return None
    return results


def format_table(results: dict[str, dict[str, float]]) -> str:
    """A text table: one row per value, one column per evaluated target."""
    names: list[str] = []
    for values in results.values():
        names += [k for k in values if k not in names]
    width = max([len(n) for n in names] + [5])
    heads = list(results)
    col = max([len(h) for h in heads] + [8])
    lines = [f"{'':{width}}  " + "  ".join(f"{h:>{col}}" for h in heads)]
    for name in names:
        cells = []
        for head in heads:
            value = results[head].get(name)
            cells.append(f"{'-' if value is None or math.isnan(value) else format(value, '.3f'):>{col}}")
        lines.append(f"{name:{width}}  " + "  ".join(cells))
    return "\n".join(lines)


MediaMaker = Callable[[list[str], torch.Tensor], MediaBatch]
"""Makes the media of held-out samples from their prompts and noise rows."""


def prompt_groups(prompts: list[str], num_samples: int) -> list[list[int]]:
    """The held-out sample indices of each prompt (a group), in prompt order."""
    used = prompts_used(prompts, num_samples)
    return [list(range(p, num_samples, used)) for p in range(min(used, num_samples))]


def join_columns(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Columns of consecutive batches joined; a column some batch lacks is NaN there."""
    names = [k for part in parts for k in part]
    joined = {}
    for name in dict.fromkeys(names):
        pieces = []
        for part in parts:
            size = len(next(iter(part.values()))) if part else 0
            pieces.append(part.get(name, torch.full((size,), math.nan)))
        joined[name] = torch.cat(pieces)
    return joined


def evaluate_heldout(
    make_media: MediaMaker,
    prompts: list[str],
    num_samples: int,
    latent_shape: tuple[int, ...],
    reward: WeightedReward | None,
    metrics: list[MetricScorer],
    max_batch: int = 256,
) -> dict[str, float]:
    """A whole held-out evaluation in this process (`odrl eval`, notebooks): batches of whole prompt
    groups of at most `max_batch` samples (at least one group each)."""
    sample_prompts = heldout_prompts(prompts, num_samples)
    noise = heldout_noise(num_samples, latent_shape)
    batches: list[list[int]] = [[]]
    for group in prompt_groups(prompts, num_samples):
        if batches[-1] and len(batches[-1]) + len(group) > max_batch:
            batches.append([])
        batches[-1] += group
    parts: list[dict[str, torch.Tensor]] = []
    reasons: list[str] = []
    for index in batches:
        batch_prompts = [sample_prompts[i] for i in index]
        media = make_media(batch_prompts, noise[index])
        parts.append(score_heldout(media, batch_prompts, reward, metrics, reasons))
    summary = summarize(join_columns(parts), metrics)
    check_scored(summary, "the held-out set", reasons)
    return summary
