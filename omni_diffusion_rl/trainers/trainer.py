"""The training loop every algorithm and every execution mode runs: batches from an experience
source, one update by the algorithm per step, sample accounting, checkpoints, evaluation, previews,
metrics and the run summary.

Parts: an `ExperienceMaker` (policy + reward + prompt stream + seeds: rollout.py), a `Learner` (the
policy, its optimizer and the processes it trains with: learner.py), an `Algorithm` (what to learn:
algorithms.py) and an `ExperienceSource` (where batches come from: sources.py; colocated generates
them here, the async modes take them from a replay buffer: execution/separate.py).

Runs as one process or several under `accelerate launch`; gradients of the trained weights are
averaged across processes, and advantages are computed on the rewards of the whole batch. All
per-step randomness derives from (seed, step, prompt group), so a resumed run replays exactly and
2 processes reproduce 1.
"""

from __future__ import annotations

import dataclasses
import json
import random
import reprlib
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from tqdm.auto import tqdm

from ..checkpoint import (
    CheckpointError,
    atomic_write_text,
    check_execution_state,
    check_training_objects,
    load_checkpoint,
    resume_fields,
    save_checkpoint,
)
from ..config import ConfigError, ExperimentConfig
from ..distributed import all_reduce_sum
from ..evaluation import (
    MetricScorer,
    before_after_summary,
    build_metrics,
    check_scored,
    heldout_noise,
    heldout_prompts,
    join_columns,
    samples_of_rank,
    score_heldout,
    summarize,
)
from ..media import save_previews
from ..models import build_nft_policy, lora
from ..models.fingerprint import fingerprint_matches, model_fingerprint
from ..models.policy import FlowPolicy
from ..precision import autocast_factory, resolve_mixed_precision
from ..prompts import load_prompts
from ..reward import RewardError, ScoreResult, WeightedReward
from ..reward_factory import reward_from_config
from ..rollout import ExperienceMaker, Rollout, generate, step_generator
from ..sharding import (
    Sharder,
    check_shardable,
    load_whole_optimizer_state,
    make_sharder,
    whole_optimizer_state,
)
from ..tracking import MetricsLogger, plot_reward_curve, read_metrics
from ..world import tiny_world
from .algorithms import algorithm_class, build_algorithm
from .learner import Learner
from .phases import LoopStart, ProcessPlace, StepPhases
from .sources import ExperienceSource, LocalSource
from .update_batch import UpdateBatch


def experience_maker(
    cfg: ExperimentConfig,
    policy: FlowPolicy,
    reward: WeightedReward,
    prompts: list[str],
    device: torch.device,
    sharder: Sharder | None = None,
) -> ExperienceMaker:
    """The experience maker of a run: generation with the algorithm's rollout weights, in the run's
    precision (answers for an answering policy: text_rollout.py); `sharder`: the training processes
    shard (an in-process teacher is sharded with them)."""
    s = cfg.sampling
    algorithm = algorithm_class(cfg.algorithm.name)
    if is_answering(policy) != algorithm.trains_answers:
        kind = "an answering language model" if is_answering(policy) else "a media generator"
        raise ConfigError(
            f"algorithm.name={cfg.algorithm.name} does not train {kind} (model.family={cfg.model.family}): "
            "gspo trains answering models (tiny_omni); nft, raft and distill train generators"
        )
    if is_answering(policy):
        from ..answer_backends import answer_backend
        from ..text_rollout import TextExperienceMaker

        a = cfg.algorithm
        precision = resolve_mixed_precision(cfg.train.mixed_precision)
        return TextExperienceMaker(  # type: ignore[return-value]
            policy,
            reward,
            prompts,
            cfg.train.seed,
            cfg.data.group_size,
            a.max_new_tokens,
            a.temperature,
            a.min_new_tokens,
            rollout_weights=lambda: algorithm.rollout_weights(policy.transformer),
            load_rollout_state=lambda tensors: algorithm.load_rollout_state(policy.transformer, tensors),
            autocast=autocast_factory(precision, device),
            backend=answer_backend(cfg, precision, lambda: algorithm.rollout_state(policy.transformer)),
        )
    return ExperienceMaker(
        policy,
        reward,
        prompts,
        cfg.train.seed,
        cfg.data.group_size,
        s.num_steps,
        s.time_shift,
        s.solver,
        s.rollout_chunks,
        rollout_weights=lambda: algorithm.rollout_weights(policy.transformer),
        load_rollout_state=lambda tensors: algorithm.load_rollout_state(policy.transformer, tensors),
        autocast=autocast_factory(resolve_mixed_precision(cfg.train.mixed_precision), device),
        annotator=algorithm.experience_annotator(cfg, policy, sharder),
    )


def is_answering(policy: Any) -> bool:
    """Whether the policy answers questions (the autoregressive path) rather than generating media."""
    return getattr(policy, "kind", None) == "answers"


def build_experience_maker(cfg: ExperimentConfig, device: torch.device) -> ExperienceMaker:
    """The policy, reward and prompt stream of a process that only makes experience (a rollout
    process): no optimizer, no eval metrics."""
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.train.seed)
    prompts = load_prompts(cfg.data.prompts)
    reward = reward_from_config(cfg.reward)
    return experience_maker(cfg, build_nft_policy(cfg.model, device), reward, prompts, device)


class Trainer:
    def __init__(
        self,
        cfg: ExperimentConfig,
        accelerator: Any | None = None,
        device: torch.device | None = None,
        group: Any = None,
        source: ExperienceSource | None = None,
    ) -> None:
        """`accelerator`: every process trains (colocated); or `device` and, when several processes
        train together (the trainer processes of an async mode), their process `group`. `source`:
        where batches come from (default: generated here, colocated)."""
        built = time.perf_counter()
        self.cfg = cfg
        self.accelerator = accelerator
        self.group = group  # None: the accelerator's processes (all of them), or this process alone
        if group is not None:
            self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        else:
            self.rank = accelerator.process_index if accelerator else 0
            self.world_size = accelerator.num_processes if accelerator else 1
        self.is_main = self.rank == 0
        if cfg.data.prompts_per_step % self.world_size:
            raise ConfigError(
                f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the "
                f"{self.world_size} processes so that each generates whole prompt groups"
            )
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True)
        torch.manual_seed(cfg.train.seed)
        self.train_prompts = load_prompts(cfg.data.prompts)
        self.eval_prompts = load_prompts(cfg.data.eval_prompts)
        self.reward = reward_from_config(cfg.reward)
        self._metrics: list[MetricScorer] | None = None  # eval metrics, built when first needed
        self.sample_counts: dict[str, int] = {}
        self.device = accelerator.device if accelerator is not None else (device or torch.device("cpu"))
        trains_answers = algorithm_class(cfg.algorithm.name).trains_answers
        self.sharder, self.sharding = make_sharder(cfg, self.world_size, group, self.device, trains_answers)
        if self.is_main and self.world_size > 1:
            print(f"odrl: {self.sharding}", file=sys.stderr, flush=True)
        self.sharded = self.sharder is not None and self.sharder.active
        self.policy = build_nft_policy(cfg.model, self.device, self.sharder.policy if self.sharded else None)
        self.transformer = self.policy.transformer
        if self.sharder is not None and not self.sharded:  # one process: whole weights, checked alike
            check_shardable(self.transformer, cfg.model.family)
        self.params = lora.trainable_parameters(self.transformer)
        self.optimizer = torch.optim.AdamW(self.params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
        self.autocast = autocast_factory(resolve_mixed_precision(cfg.train.mixed_precision), self.device)
        self.learner = Learner(
            cfg, self.policy, self.params, self.optimizer, self.rank, self.world_size, group, self.device
        )
        self.learner.autocast = self.autocast
        self.learner.sharded = self.sharded
        self.algorithm = build_algorithm(self.learner)
        self.experience = experience_maker(
            cfg, self.policy, self.reward, self.train_prompts, self.device, self.sharder
        )
        self.source = source or LocalSource()
        self.source.attach(self)
        self.step = 0
        self.eval_before: dict[str, float] | None = None
        self.output_dir = Path(cfg.train.output_dir)
        self.recheck: Any = None  # auto: execution.planner.recheck.AutoRecheck, told about every step
        self.wandb_run_id = uuid.uuid4().hex[:16]  # kept in checkpoints: a resumed run logs to the same run
        self.building_started_at = built
        self.built_at = time.perf_counter()
        self.build_s = self.built_at - built
        self.save_s = 0.0  # the last checkpoint's seconds (part of what a mode switch costs)
        self.step_times = (0.0, 0.0, 0.0)  # the last step's generation, reward wait and training seconds

    # ------------------------------------------------------------------ identity and state
    def model_fingerprint(self) -> str:
        """What a checkpoint must match: the model and its adapters (not the training knobs)."""
        return model_fingerprint(dataclasses.asdict(self.cfg.model), self.transformer)

    def save(self) -> Path | None:
        started = time.perf_counter()
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        path = None
        if self.is_main or self.sharded:  # sharded: every process gathers the whole tensors with it
            tensors = self.algorithm.checkpoint_tensors()
            optimizer = whole_optimizer_state(self.optimizer) if self.sharded else self.optimizer.state_dict()
        if self.is_main:
            objects = {
                "optimizer": optimizer,
                "torch_rng": torch.get_rng_state(),
                "python_rng": random.getstate(),
                "numpy_rng": np.random.get_state(),
            }
            state = {
                "step": self.step,
                "data_position": self.step * self.cfg.data.prompts_per_step,
                "model_fingerprint": self.model_fingerprint(),
                "eval_before": self.eval_before,
                "sample_counts": self.sample_counts,
                "wandb_run_id": self.wandb_run_id,
                "config": self.cfg.to_dict(),
                **self.source.state_dict(),
            }
            path = save_checkpoint(self.output_dir / "checkpoints", self.step, tensors, objects, state)
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        self.save_s = time.perf_counter() - started
        return path

    def load(self, path: str | Path) -> None:
        """Resume from a checkpoint (--resume): its adapters, optimizer and RNG states, step, counters
        and the source's state. Only the run's own config decides what runs; every field taken from
        the checkpoint is checked (checkpoint.resume_fields and the checks it names) before any is
        applied, and anything wrong is a CheckpointError that says what."""
        tensors, objects, state = load_checkpoint(path)
        if not fingerprint_matches(state, dataclasses.asdict(self.cfg.model), self.transformer):
            saved = state.get("config", {}).get("model") if isinstance(state.get("config"), dict) else None
            raise CheckpointError(
                f"checkpoint {path} was made for another model configuration ({reprlib.repr(saved)}); "
                f"this run uses {dataclasses.asdict(self.cfg.model)}"
            )
        resumed = resume_fields(state, path)
        check_execution_state(state, path)
        check_training_objects(objects, self.optimizer, path)
        try:
            self.algorithm.load_checkpoint_tensors(tensors)
            load_whole_optimizer_state(self.optimizer, objects["optimizer"])
            torch.set_rng_state(objects["torch_rng"])
            random.setstate(objects["python_rng"])
            np.random.set_state(objects["numpy_rng"])
            self.step = resumed.step
            self.source.load_state_dict(state)
        except (KeyError, ValueError, TypeError, RuntimeError, OverflowError) as e:
            raise CheckpointError(f"checkpoint {path} does not fit this run: {e}") from e
        self.eval_before = resumed.eval_before
        self.sample_counts = resumed.sample_counts
        self.wandb_run_id = resumed.wandb_run_id or self.wandb_run_id

    @property
    def metrics(self) -> list[MetricScorer]:
        """The eval metrics (logged, never trained on); built on first use, so processes that never
        evaluate (rollout workers, cost measurement) never load them."""
        if self._metrics is None:
            self._metrics = build_metrics(self.cfg.eval.metrics, self.cfg.eval.options)
        return self._metrics

    def close_scorers(self) -> None:
        """Close the reward, the eval metrics, the experience's annotator (a teacher's thread and
        connections) and its answer sampler (a vLLM engine)."""
        self.reward.close()
        for metric in self._metrics or []:
            metric.close()
        annotator = self.experience.annotator
        if annotator is not None and hasattr(annotator, "close"):
            annotator.close()
        backend = getattr(self.experience, "backend", None)  # an answer sampler (a vLLM engine)
        if backend is not None and hasattr(backend, "close"):
            backend.close()

    # ------------------------------------------------------------------ data
    def prompts_for_step(self, step: int) -> tuple[list[str], list[int]]:
        """This rank's prompts (and their global group ids) for `step`; epochs are reshuffled."""
        per_step = self.cfg.data.prompts_per_step
        positions = range(step * per_step, (step + 1) * per_step)
        chosen = [self.prompt_at(pos) for pos in positions]
        local = per_step // self.world_size
        mine = range(self.rank * local, (self.rank + 1) * local)
        return [chosen[i] for i in mine], [step * per_step + i for i in mine]

    def prompt_at(self, position: int) -> str:
        """The prompt at a position of the data stream: every epoch is a fresh permutation."""
        return self.experience.prompt_at(position)

    # ------------------------------------------------------------------ one step
    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        return self.learner.gather(t)

    def _agree_on_failure(self, error: BaseException | None, what: str) -> None:
        """Raise on every process when one failed (the others would wait for it in a collective)."""
        failed = error is not None
        if self.world_size > 1:
            flag = all_reduce_sum(torch.tensor([1.0 if failed else 0.0]), self.group, self.device)
            failed = bool(flag.item() > 0)
        if error is not None:
            raise error
        if failed:
            raise RewardError(f"another process failed while {what}; its error is in its own output")

    def _gather_parts(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named score gathered over processes; a name some process lacks is NaN there."""
        names = sorted(parts)
        if self.world_size > 1:
            everyone: list[list[str]] = [[] for _ in range(self.world_size)]
            dist.all_gather_object(everyone, names, group=self.group)
            names = sorted({n for ns in everyone for n in ns})
        size = len(next(iter(parts.values()))) if parts else 0
        nan = torch.full((size,), float("nan"))
        return {n: self._gather(parts.get(n, nan)) for n in names}

    def train_step(self) -> dict[str, float]:
        """This process's share of the step from the source, one update, the source told."""
        step = self.step
        t0 = time.perf_counter()
        error = None
        try:
            rollout, scored = self.source.next_batch(step)
            if self.world_size > 1:  # a teacher's failure must be agreed on before any collective
                rollout.settle()
        except Exception as e:
            error = e
        self._agree_on_failure(error, f"generating or scoring step {step + 1}")
        metrics = self.learn_from(step, rollout, scored, t0)
        metrics.update(self.source.after_step(self.last_ok, self.last_keep))
        return metrics

    def learn_from(self, step: int, rollout: Rollout, scored: ScoreResult, t0: float) -> dict[str, float]:
        """Advantages over the gathered step, drops, one optimizer step, accounting and metrics."""
        t2 = time.perf_counter()
        generated_at = self.source.generated_at
        all_rewards = self._gather(scored.total)
        all_groups = self._gather(rollout.group_ids)
        all_ok = self._gather(scored.ok)
        self.reward.check_failures(int((~all_ok).sum()), len(all_ok), list(scored.failures.values()))
        keep_all = trainable_samples(all_ok, all_groups)
        self.last_ok, self.last_keep = all_ok, keep_all  # which samples of the step were scored, trained
        local = slice(self.rank * len(rollout), (self.rank + 1) * len(rollout))
        self._record_failures(step, rollout, scored, keep_all[local])
        if keep_all.any():
            metrics = self.algorithm.update(
                UpdateBatch(rollout, all_rewards, all_groups, keep_all, local, step)
            )
        else:  # every process agrees (keep_all is gathered): nothing to learn from, no update at all
            metrics = {"step_skipped": 1.0}
        t3 = time.perf_counter()
        self.step += 1
        self.step_times = (generated_at - t0, t2 - generated_at, t3 - t2)  # generate, reward wait, train
        counts = {
            "generated": len(all_ok),
            "trained": int(keep_all.sum()),
            "dropped/reward_failed": int((~all_ok).sum()),
            "dropped/group_too_small": int((all_ok & ~keep_all).sum()),
        }
        for name, n in counts.items():
            self.sample_counts[name] = self.sample_counts.get(name, 0) + n
        kept_rewards = all_rewards[keep_all]
        metrics.update(
            {
                "reward/mean": float(kept_rewards.mean()) if len(kept_rewards) else float("nan"),
                "reward/std": float(kept_rewards.std(correction=0)) if len(kept_rewards) else float("nan"),
                "time/rollout_s": generated_at - t0,
                "time/reward_wait_s": t2 - generated_at,
                "time/train_s": t3 - t2,
                "time/sec_per_prompt": (t3 - t0) / (self.cfg.data.prompts_per_step // self.world_size),
                **{f"samples/{k}": float(v) for k, v in self.sample_counts.items()},
            }
        )
        for name, gathered in self._gather_parts(scored.parts).items():
            metrics[f"reward/{name}"] = float(gathered[keep_all].mean()) if keep_all.any() else float("nan")
        if self.device.type == "cuda":  # the most any training process's device has held so far
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], dtype=torch.float64)
            metrics["memory/max_allocated_gib"] = float(self._gather(peak).max())
        return metrics

    def failures_path(self) -> Path:
        """This process's log of dropped samples (one file per process)."""
        suffix = "" if self.rank == 0 else f".rank{self.rank}"
        return self.output_dir / f"failed_samples{suffix}.jsonl"

    def _record_failures(self, step: int, rollout: Rollout, scored: ScoreResult, keep: torch.Tensor) -> None:
        """Append every dropped sample of this rank, with its reason, to failed_samples.jsonl."""
        lines = []
        for i in (~keep).nonzero().flatten().tolist():
            reason = scored.failures.get(i, "its prompt group has fewer than 2 scored samples")
            record = {"step": step + 1, "rank": self.rank, "group": int(rollout.group_ids[i])}
            lines.append(json.dumps({**record, "prompt": rollout.prompts[i], "reason": reason}))
        if lines:
            with open(self.failures_path(), "a", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in lines))

    # ------------------------------------------------------------------ evaluation and previews
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The training reward and the eval metrics on the held-out set (fixed prompts and noise,
        whatever the seed), generated with the trained adapter; see `evaluation`."""
        if is_answering(self.policy):
            return self._evaluate_answers()
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
        self._agree_on_failure(error, "evaluating the held-out set")  # the others would wait to gather
        summary = summarize(self._gather_parts(join_columns(parts)), self.metrics)
        check_scored(summary, "the held-out set", reasons)
        return summary

    def _evaluate_answers(self) -> dict[str, float]:
        """Held-out exact-answer accuracy, greedy and sampled (accuracy/...), and the training reward
        of the greedy answers (reward, reward/...): the same questions, clips and random numbers at
        every evaluation. Every process computes it whole (it is small)."""
        from ..avqa_eval import answer_questions, avqa_accuracy
        from ..media import MediaBatch
        from ..tiny_clip import FPS, SAMPLE_RATE
        from ..world.avqa import parse_question

        per_question = max(1, self.cfg.data.eval_samples // len(self.eval_prompts))
        pool = [parse_question(p) for p in self.eval_prompts]
        seed, limit = self.cfg.train.seed, self.cfg.algorithm.max_new_tokens
        accuracy = avqa_accuracy(self.policy.model, pool, per_question, seed, limit)
        chosen = [q for q in pool for _ in range(per_question)]
        answers, video, audio = answer_questions(self.policy.model, chosen, seed, True, limit)
        prompts = [p for p in self.eval_prompts for _ in range(per_question)]
        media = MediaBatch(video=video, audio=audio, fps=FPS, sample_rate=SAMPLE_RATE, text=answers)
        scored = self.reward(media, prompts)
        out = {f"accuracy/{k}": v for k, v in accuracy.items()}
        out["reward"] = float(scored.total.mean())
        out |= {f"reward/{k}": float(v.mean()) for k, v in scored.parts.items()}
        return out

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
        s = self.cfg.sampling
        with self.autocast():
            return generate(
                self.policy,
                prompts,
                list(range(len(prompts))),
                noise,
                s.eval_num_steps,
                s.time_shift,
                s.solver,
            )

    def _evaluate_logged(self, logger: MetricsLogger) -> dict[str, float]:
        """evaluate() logged as eval/...; when it fails, the logger and the scorers are closed first."""
        try:
            result = self.evaluate()
        except BaseException:
            logger.close()
            self.close_scorers()
            raise
        logger.log({f"eval/{k}": v for k, v in result.items()}, step=self.step)
        return result

    @torch.no_grad()
    def preview(self, tag: str, prompts_shown: int = 4, samples_per_prompt: int = 2) -> Path | None:
        """Samples of held-out prompts with their rewards and eval metrics (a failed score is shown as
        failed); for the tiny world the sheet puts the world's own render of each prompt beside them."""
        if not self.is_main and not self.sharded:
            return None
        if is_answering(self.policy):
            return self._preview_answers(tag, prompts_shown * samples_per_prompt)
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
        reference = None
        if self.cfg.model.family == "tiny_av":
            rendered = tiny_world.render_prompts(prompts, step_generator(0, 0, 0, "preview"))
            reference = None if rendered is None else rendered[0]
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

    def _preview_answers(self, tag: str, shown: int) -> Path:
        """Held-out questions with their clips and the model's greedy answers side by side (the
        sheet's title per clip: question, answer, the right answer)."""
        from ..avqa_eval import answer_questions
        from ..media import MediaBatch
        from ..tiny_clip import FPS, SAMPLE_RATE
        from ..world.avqa import exact_match, parse_question

        n = len(self.eval_prompts)
        stride = max(1, n // shown)  # spread over the set, stepping one more each time to vary the kind
        chosen = [parse_question(self.eval_prompts[(i * stride + i) % n]) for i in range(min(shown, n))]
        answers, video, audio = answer_questions(self.policy.model, chosen, 0, greedy=True)
        pairs = list(zip(chosen, answers, strict=True))
        titles = [f"Q: {q.text} | A: {a or '(empty)'} | right: {q.answer}" for q, a in pairs]
        right = [exact_match(a, q) for q, a in pairs]
        out = self.output_dir / "previews" / tag
        media = MediaBatch(video=video, audio=audio, fps=FPS, sample_rate=SAMPLE_RATE, text=answers)
        save_previews(out, media, titles, {"avqa_exact": right})
        return out

    # ------------------------------------------------------------------ the loop
    def fit(self, resume: str | None = None) -> dict[str, Any]:
        """Train to train.steps (from `resume`, a checkpoint); the run summary. The source is started
        after the checkpoint is loaded and stopped on any failure."""
        if resume:
            self.load(resume)
        try:
            self.source.start()
            return self._loop()
        except BaseException:
            self.source.abort()
            raise

    def _loop(self) -> dict[str, Any]:
        cfg = self.cfg
        self.output_dir.mkdir(parents=True, exist_ok=True)
        metrics_path = self.output_dir / "metrics.jsonl"
        if self.is_main:
            _truncate_metrics(metrics_path, keep_until=self.step)
        _truncate_metrics(self.failures_path(), keep_until=self.step)
        logger = MetricsLogger(
            self.output_dir,
            self.accelerator,
            use_wandb=cfg.tracking.wandb,
            project=cfg.tracking.project,
            run_name=cfg.tracking.run_name or self.output_dir.name,
            config=cfg.to_dict(),
            run_id=self.wandb_run_id,
            is_main_process=self.is_main,
        )
        start = time.perf_counter()
        if cfg.train.eval_at_start_and_end and self.eval_before is None:
            self.eval_before = self._evaluate_logged(logger)
            if cfg.train.preview_every:
                self.preview(f"step_{self.step:05d}")
        evaluating_s = time.perf_counter() - start
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            desc=self.algorithm.display_name,
            disable=not (cfg.train.progress and self.is_main),
        )
        first_step, loop_start = self.step, time.perf_counter()
        startup_s = self.build_s + loop_start - self.built_at - evaluating_s  # what a restart costs
        place = ProcessPlace(self.rank, self.world_size, self.device, self.source.share_group)
        if self.recheck is not None:
            self.recheck.loop_started(LoopStart(self.building_started_at, startup_s), cfg.execution)
        switching = False  # auto: the re-check stops this mode here to resume in another
        try:
            while self.step < cfg.train.steps and not switching:
                metrics = self.train_step()
                loop_end = time.perf_counter()
                if self.step == first_step + 1:
                    first_step_end = loop_end
                if self.step % cfg.train.log_every == 0 or self.step == cfg.train.steps:
                    logger.log(metrics, step=self.step)
                bar.update(1)
                bar.set_postfix(
                    reward=f"{metrics['reward/mean']:.3f}",
                    loss=f"{metrics.get('loss/total', float('nan')):.3f}",
                    s_per_prompt=f"{metrics['time/sec_per_prompt']:.2f}",
                )
                if cfg.train.preview_every and self.step % cfg.train.preview_every == 0:
                    self.preview(f"step_{self.step:05d}")
                    if self.is_main:
                        plot_reward_curve(read_metrics(metrics_path), self.output_dir / "reward_curve.png")
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                    self.save()
                if self.recheck is not None:  # the step's phases, its checkpoint (if any) saved
                    phases = StepPhases(self.step, *self.step_times, self.source.rollout_group_s, self.save_s)
                    switching = self.recheck.after_step(phases, place)
        except BaseException:
            self.close_scorers()  # connections and the scoring thread; the error propagates
            raise
        finally:
            bar.close()
        if not cfg.train.checkpoint_every or self.step % cfg.train.checkpoint_every:
            self.save()
        summary: dict[str, Any] = {
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "seconds": round(time.perf_counter() - start, 2),
        }
        p = cfg.data.prompts_per_step
        if self.step > first_step:  # the training loop alone: start-up, evaluation and saving excluded
            whole = (loop_end - loop_start) / (self.step - first_step) / p
            summary["seconds_per_trained_prompt"] = round(whole, 4)
        if self.step > first_step + 1:  # and without the first step (async modes fill their buffer)
            steady = (loop_end - first_step_end) / (self.step - first_step - 1) / p
            summary["steady_seconds_per_trained_prompt"] = round(steady, 4)
        try:
            summary.update(self.source.finish())
        except BaseException:
            logger.close()
            self.close_scorers()
            raise
        if cfg.train.eval_at_start_and_end and not switching:  # a switch continues the run elsewhere
            after = self._evaluate_logged(logger)
            summary = {**before_after_summary(self.eval_before or {}, after, self.metrics), **summary}
        logger.close()
        self.close_scorers()
        summary["samples"] = dict(self.sample_counts)
        if self.is_main:
            plot_reward_curve(read_metrics(metrics_path), self.output_dir / "reward_curve.png")
            if self.recheck is None:  # under auto, its driver writes the whole run's summary once
                atomic_write_text(self.output_dir / "summary.json", json.dumps(summary, indent=1))
        return summary


def _truncate_metrics(path: Path, keep_until: int) -> None:
    """Drop records logged after the checkpoint a run resumes from (they will be logged again)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line torn by a crash mid-write
            continue
        if record.get("step", 0) <= keep_until:
            kept.append(line)
    path.write_text("".join(line + "\n" for line in kept), encoding="utf-8")


def trainable_samples(ok: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """[N] bool: scored samples whose prompt group kept at least 2 scored samples."""
    _, inverse = torch.unique(group_ids, return_inverse=True)
    scored_per_group = torch.zeros(int(inverse.max()) + 1 if len(inverse) else 0, dtype=torch.long)
    scored_per_group.index_add_(0, inverse, ok.long())
    return ok & (scored_per_group[inverse] >= 2)
