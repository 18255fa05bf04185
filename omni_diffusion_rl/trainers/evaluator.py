"""Held-out evaluation and previews of the trained weights: the training reward and the eval metrics
(logged, never trained on) on a fixed held-out set, and sample sheets of held-out prompts. Sharded
runs generate in lockstep on every process; the others split the set by process and gather."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..config import ConfigError, ExperimentConfig
from ..evaluation.heldout import (
    MetricScorer,
    build_metrics,
    check_scored,
    heldout_noise,
    heldout_prompts,
    join_columns,
    samples_of_rank,
    score_heldout,
    summarize,
)
from ..experience.rollout import Rollout, generate_for_eval, step_generator
from ..media import save_previews
from ..registry import evaluations, preview_references
from ..reward import WeightedReward
from .learner import Learner


class HeldOut:
    """The held-out set of a generator's run, evaluated and previewed with the trained weights."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        learner: Learner,
        reward: WeightedReward,
        eval_prompts: list[str],
        output_dir: Path,
        sharded: bool,
    ) -> None:
        self.cfg, self.learner, self.reward = cfg, learner, reward
        self.policy, self.autocast = learner.policy, learner.autocast
        self.eval_prompts, self.output_dir, self.sharded = eval_prompts, output_dir, sharded
        self.rank, self.world_size = learner.rank, learner.world_size
        self.is_main = self.rank == 0
        self._metrics: list[MetricScorer] | None = None

    @property
    def metrics(self) -> list[MetricScorer]:
        """The eval metrics (logged, never trained on); built on first use, so processes that never
        evaluate (rollout workers, cost measurement) never load them."""
        if self._metrics is None:
            self._metrics = build_metrics(self.cfg.eval.metrics, self.cfg.eval.options)
        return self._metrics

    def close(self) -> None:
        """Close the eval metrics built so far."""
        for metric in self._metrics or []:
            metric.close()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The training reward and the eval metrics on the held-out set (fixed prompts and noise,
        whatever the seed), generated with the trained adapter; see `evaluation`."""
        n, prompts = self.cfg.data.eval_samples, self.eval_prompts
        mine = samples_of_rank(prompts, n, self.rank, self.world_size)
        parts: list[dict[str, torch.Tensor]] = []
        reasons: list[str] = []
        error = None
        try:
            sample_prompts = heldout_prompts(prompts, n)
            noise = heldout_noise(n, self.policy.latent_shape)
            batches = self._eval_batches(mine, sample_prompts)
            sizes = self._lockstep_eval_sizes(prompts, sample_prompts)  # sharded: every process's
            for j, index in enumerate(batches):
                size = sizes[j] if sizes else len(index)
                parts.append(
                    self._score_heldout_batch([sample_prompts[i] for i in index], noise[index], reasons, size)
                )
            for size in sizes[len(batches) :]:  # batches another process has and this one has not
                self._generate_trained(sample_prompts[:1] * size, noise[:1].expand(size, *noise.shape[1:]))
        except Exception as e:
            error = e
        self.learner.agree_on_failure(error, "evaluating the held-out set")  # the others would wait to gather
        summary = summarize(self.learner.gather_named(join_columns(parts)), self.metrics)
        check_scored(summary, "the held-out set", reasons)
        return summary

    def _lockstep_eval_sizes(self, prompts: list[str], sample_prompts: list[str]) -> list[int]:
        """Sharded: the size of each held-out batch, the largest any process has at that place (each
        process generates batches of these sizes, padding its own and discarding the padding, since
        FSDP gathers every block in lockstep and a policy may call its transformer once per sample);
        unsharded: []."""
        if not self.sharded:
            return []
        n = self.cfg.data.eval_samples
        every = [
            self._eval_batches(samples_of_rank(prompts, n, rank, self.world_size), sample_prompts)
            for rank in range(self.world_size)
        ]
        most = max(len(batches) for batches in every)
        return [max(len(b[j]) if j < len(b) else 0 for b in every) for j in range(most)]

    def _eval_batches(self, mine: list[int], sample_prompts: list[str]) -> list[list[int]]:
        """This process's held-out samples in batches of whole prompt groups, each no larger than a
        training step's rollout (which is known to fit) unless one group is."""
        limit = self.cfg.data.prompts_per_step * self.cfg.data.group_size
        batches: list[list[int]] = []
        groups: dict[str, list[int]] = {}
        for i in mine:
            groups.setdefault(sample_prompts[i], []).append(i)
        for group in groups.values():
            if not batches or len(batches[-1]) + len(group) > limit:
                batches.append([])
            batches[-1] += group
        return batches

    def _score_heldout_batch(
        self, prompts: list[str], noise: torch.Tensor, reasons: list[str], size: int | None = None
    ) -> dict:
        """Generate and score one held-out batch; `size` > len(prompts): padded with copies of the
        first sample, which are generated (sharded lockstep) and not scored."""
        pad = (size or len(prompts)) - len(prompts)
        padded = noise if pad == 0 else torch.cat([noise, noise[:1].expand(pad, *noise.shape[1:])])
        rollout = self._generate_trained(prompts + prompts[:1] * pad, padded)
        x0 = rollout.x0[: len(prompts)]
        return score_heldout(self.policy.decode(x0), prompts, self.reward, self.metrics, reasons)

    def _generate_trained(self, prompts: list[str], noise: torch.Tensor) -> Rollout:
        """One sample per noise row with the trained weights at the eval sampling steps (evaluation
        and previews), in the run's precision."""
        with self.autocast():
            return generate_for_eval(self.policy, prompts, noise, self.cfg.sampling)

    @torch.no_grad()
    def preview(self, tag: str, prompts_shown: int = 4, samples_per_prompt: int = 2) -> Path | None:
        """Samples of held-out prompts with their rewards and eval metrics (a failed score is shown as
        failed), beside the model family's own render of each prompt when it has one (the tiny
        world's, for tiny_av)."""
        if not self.is_main and not self.sharded:
            return None
        stride = max(1, len(self.eval_prompts) // prompts_shown)
        chosen = self.eval_prompts[::stride][:prompts_shown]  # spread over the held-out set
        prompts = [p for p in chosen for _ in range(samples_per_prompt)]
        noise = torch.randn(
            (len(prompts), *self.policy.latent_shape), generator=step_generator(0, 0, 0, "preview")
        )
        rollout = self._generate_trained(prompts, noise)  # sharded: every process takes part
        if not self.is_main:
            return None
        media = self.policy.decode(rollout.x0)
        failures: dict[int, str] = {}
        columns = score_heldout(media, prompts, self.reward, self.metrics, sample_failures=failures)
        rewards = {k: v for k, v in columns.items() if k == "reward" or k.startswith("reward/")}
        metrics = {k: v for k, v in columns.items() if k not in rewards}
        reference = self._reference(prompts)
        out = self.output_dir / "previews" / tag
        save_previews(
            out,
            media,
            prompts,
            rewards,
            metrics,
            reference=reference,
            reference_title="left: the world's own render of the prompt | right: the model's sample",
            failures=failures,
        )
        return out

    def _reference(self, prompts: list[str]) -> torch.Tensor | None:
        """The model family's own render of each prompt, shown beside the samples, when one is
        registered (registry.preview_references; tiny_av: the tiny world's render)."""
        family = self.cfg.model.family
        if family not in preview_references.names():
            return None
        rendered = preview_references.get(family)(prompts, step_generator(0, 0, 0, "preview"))
        return None if rendered is None else rendered[0]


class AnswerHeldOut(HeldOut):
    """The held-out set of an answering policy's run: evaluated and previewed by the evaluation
    registered for its model family (registry.evaluations), with the trained weights; the eval
    metrics are the config's, as for a generator."""

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        return self._evaluation().evaluate()

    @torch.no_grad()
    def preview(self, tag: str, prompts_shown: int = 4, samples_per_prompt: int = 2) -> Path | None:
        """The registered evaluation's preview of `prompts_shown * samples_per_prompt` answers."""
        if not self.is_main and not self.sharded:
            return None
        return self._evaluation().preview(
            self.output_dir / "previews" / tag, prompts_shown * samples_per_prompt
        )

    def _evaluation(self) -> Any:
        family = self.cfg.model.family
        if family not in evaluations.names():
            raise ConfigError(
                f"model.family={family} answers questions, but no held-out evaluation is registered for "
                f"it (registered: {', '.join(evaluations.names()) or 'none'}); register a class with "
                "evaluate() and preview(folder, shown) by @omni_diffusion_rl.registry.evaluations.register"
                f"('{family}') or the entry-point group '{evaluations.entry_point_group}'"
            )
        return evaluations.get(family)(self.cfg, self.policy, self.reward, self.eval_prompts)
