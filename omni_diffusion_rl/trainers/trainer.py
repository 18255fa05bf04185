"""The training loop every algorithm and every execution mode runs: batches from an experience
source, one update by the algorithm per step, sample accounting, checkpoints, evaluation, previews,
metrics and the run summary.

Parts: an `ExperienceMaker` (policy + reward + prompt stream + seeds: experience/rollout.py), a `Learner` (the
policy, its optimizer and the processes it trains with: learner.py), an `Algorithm` (what to learn:
algorithms.py) and an `ExperienceSource` (where batches come from: sources.py; colocated generates
them here, the async modes take them from a replay buffer: execution/separate.py); the held-out
set (evaluator.py), the checkpoints (run_checkpoints.py) and the sample accounting (accounting.py).

Runs as one process or several under `accelerate launch`; gradients of the trained weights are
averaged across processes, and advantages are computed on the rewards of the whole batch. All
per-step randomness derives from (seed, step, prompt group), so a resumed run replays exactly and
2 processes reproduce 1.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

# peft is loaded with the training stack, before any timed phase: models.lora imports it only when
# adapters are injected, and auto's re-check counts a mode's start-up as the cost of a switch.
import peft  # noqa: F401
import torch
from tqdm.auto import tqdm

from ..checkpoint import atomic_write_text
from ..config import ConfigError, ExperimentConfig
from ..evaluation.heldout import before_after_summary
from ..experience.rollout import ExperienceMaker, Rollout
from ..models import build_nft_policy
from ..prompts import split_prompts
from ..reward import ScoreResult
from ..reward_factory import reward_from_config
from ..tracking import MetricsLogger, plot_reward_curve, read_metrics
from .accounting import count_samples, failures_path, record_dropped, reward_metrics, trainable_samples
from .credit import check_credit_rewards
from .experience_kinds import experience_kind
from .learner import build_learner, rank_and_size
from .phases import LoopStart, ProcessPlace, StepPhases
from .run_checkpoints import RunCheckpoints
from .skeleton import build_algorithm
from .sources import ExperienceSource, LocalSource, SourceContext
from .update_batch import UpdateBatch


def close_experience(experience: ExperienceMaker) -> None:
    """Close what an experience maker holds open: its annotator (a teacher's thread and connections)
    and its answer sampler (a vLLM engine)."""
    for part in (experience.annotator, getattr(experience, "backend", None)):
        if part is not None and hasattr(part, "close"):
            part.close()


def start_process(cfg: ExperimentConfig, processes: int = 1) -> None:
    """Check that each of the `processes` training together gets whole prompt groups; set torch's
    determinism and seed as the config says."""
    if cfg.data.prompts_per_step % processes:
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the "
            f"{processes} processes so that each generates whole prompt groups"
        )
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.train.seed)


def build_experience_maker(cfg: ExperimentConfig, device: torch.device) -> ExperienceMaker:
    """The policy, reward and prompt stream of a process that only makes experience (a rollout
    process): no optimizer, no eval metrics."""
    start_process(cfg)
    prompts = split_prompts(cfg.data, "train")
    reward = reward_from_config(cfg.reward)
    policy = build_nft_policy(cfg.model, device)
    return experience_kind(cfg, policy).make_experience(cfg, policy, reward, prompts, device)


class Trainer:
    """One training process's run: the loop, and the parts it owns (see the module docstring)."""

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
        self.rank, self.world_size = rank_and_size(accelerator, group)
        self.is_main = self.rank == 0
        start_process(cfg, self.world_size)
        self.train_prompts, self.eval_prompts = (split_prompts(cfg.data, s) for s in ("train", "heldout"))
        self.reward = reward_from_config(cfg.reward)
        check_credit_rewards(cfg.algorithm, self.reward.modalities, self.reward.weights)  # before the model
        self.sample_counts: dict[str, int] = {}
        self.device = accelerator.device if accelerator is not None else (device or torch.device("cpu"))
        self.learner, self.sharder, self.sharding = build_learner(
            cfg, self.device, self.rank, self.world_size, group
        )
        self.sharded = self.learner.sharded
        self.policy, self.transformer = self.learner.policy, self.learner.transformer
        learner = self.learner
        self.params, self.optimizer, self.autocast = learner.params, learner.optimizer, learner.autocast
        self.algorithm = build_algorithm(self.learner, self.reward)
        self.kind = experience_kind(cfg, self.policy)  # media or answers: all that differs lives there
        self.experience = self.kind.make_experience(
            cfg, self.policy, self.reward, self.train_prompts, self.device, self.sharder
        )
        self.step = 0
        self.heldout = self.kind.held_out(
            cfg, self.learner, self.reward, self.eval_prompts, Path(cfg.train.output_dir), self.sharded
        )
        self.source = source or LocalSource()
        self.source.attach(
            SourceContext(
                cfg=cfg,
                experience=self.experience,
                device=self.device,
                world_size=self.world_size,
                sharded=self.sharded,
                step_clock=lambda: self.step,
                prompts_for_step=self.prompts_for_step,
                rollout_state=lambda: self.algorithm.rollout_state(self.transformer),
            )
        )
        self.eval_before: dict[str, float] | None = None
        self.loop_started = self.trained_s = self.trained_s_before = 0.0  # training s: no evals, resumed in
        self.evaluating_s = self.evaluating_s_at_loop = 0.0  # held-out evaluations' seconds
        self.output_dir = Path(cfg.train.output_dir)
        self.checkpoints = RunCheckpoints(
            cfg,
            self.algorithm,
            self.optimizer,
            self.source,
            self.is_main,
            self.sharded,
            self.output_dir,
        )
        self.recheck: Any = None  # auto: execution.planner.recheck.AutoRecheck, told about every step
        self.wandb_run_id = uuid.uuid4().hex[:16]  # kept in checkpoints: a resumed run logs to the same run
        self.building_started_at = built
        self.built_at = time.perf_counter()
        self.build_s = self.built_at - built
        self.save_s = 0.0  # the last checkpoint's seconds (part of what a mode switch costs)
        self.step_times = (0.0, 0.0, 0.0)  # the last step's generation, reward wait and training seconds

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> Path | None:
        """A checkpoint of this step (run_checkpoints.py); its path on the main process."""
        started = time.perf_counter()
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        progress = {
            "eval_before": self.eval_before,
            "sample_counts": self.sample_counts,
            "wandb_run_id": self.wandb_run_id,
            "train_seconds": self.trained_s,
        }
        path = self.checkpoints.save(self.step, progress)
        if self.accelerator is not None:
            self.accelerator.wait_for_everyone()
        self.save_s = time.perf_counter() - started
        return path

    def load(self, path: str | Path) -> None:
        """Resume from a checkpoint (--resume): see RunCheckpoints.load."""
        resumed = self.checkpoints.load(path, lambda step: setattr(self, "step", step))
        self.eval_before, self.sample_counts = resumed.eval_before, resumed.sample_counts
        self.wandb_run_id = resumed.wandb_run_id or self.wandb_run_id
        self.trained_s = self.trained_s_before = resumed.train_seconds

    def close_scorers(self) -> None:
        """Close the reward, the eval metrics, the experience's annotator (a teacher's thread and
        connections) and its answer sampler (a vLLM engine)."""
        self.reward.close()
        self.heldout.close()
        close_experience(self.experience)

    # ------------------------------------------------------------------ data
    def prompts_for_step(self, step: int) -> tuple[list[str], list[int]]:
        """This rank's prompts (and their global group ids) for `step`; epochs are reshuffled."""
        return step_prompts(step, self.cfg.data.prompts_per_step, self.rank, self.world_size, self.prompt_at)

    def prompt_at(self, position: int) -> str:
        """The prompt at a position of the data stream: every epoch is a fresh permutation."""
        return self.experience.prompt_at(position)

    # ------------------------------------------------------------------ one step
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
        self.learner.agree_on_failure(error, f"generating or scoring step {step + 1}")
        metrics = self.learn_from(step, rollout, scored, t0)
        metrics.update(self.source.after_step(self.last_ok, self.last_keep))
        return metrics

    def learn_from(self, step: int, rollout: Rollout, scored: ScoreResult, t0: float) -> dict[str, float]:
        """Advantages over the gathered step, drops, one optimizer step, accounting and metrics."""
        t2 = time.perf_counter()
        generated_at = self.source.generated_at
        gather = self.learner.gather
        all_rewards, all_groups, all_ok = gather(scored.total), gather(rollout.group_ids), gather(scored.ok)
        self.reward.check_failures(int((~all_ok).sum()), len(all_ok), list(scored.failures.values()))
        keep_all = trainable_samples(all_ok, all_groups)
        self.last_ok, self.last_keep = all_ok, keep_all  # which samples of the step were scored, trained
        local = slice(self.rank * len(rollout), (self.rank + 1) * len(rollout))
        path = failures_path(self.output_dir, self.rank)
        record_dropped(path, step, self.rank, rollout, scored, keep_all[local])
        all_parts = self.learner.gather_named(scored.parts)  # each reward's own scores ride along too
        if keep_all.any():
            scores = (all_rewards, all_groups, keep_all)
            update = UpdateBatch.scored(rollout, *scores, local, step, all_parts, self.reward)
            metrics = self.algorithm.update(update)
        else:  # every process agrees (keep_all is gathered): nothing to learn from, no update at all
            metrics = {"step_skipped": 1.0}
        t3 = time.perf_counter()
        self.step += 1
        self.step_times = (generated_at - t0, t2 - generated_at, t3 - t2)  # generate, reward wait, train
        count_samples(self.sample_counts, all_ok, keep_all)
        metrics |= reward_metrics(all_rewards, all_parts, keep_all)
        metrics |= {
            "time/rollout_s": generated_at - t0,
            "time/reward_wait_s": t2 - generated_at,
            "time/train_s": t3 - t2,
            "time/sec_per_prompt": (t3 - t0) / (self.cfg.data.prompts_per_step // self.world_size),
            **{f"samples/{k}": float(v) for k, v in self.sample_counts.items()},
        }
        if self.device.type == "cuda":  # the most any training process's device has held so far
            peak = torch.tensor([torch.cuda.max_memory_allocated(self.device) / 2**30], dtype=torch.float64)
            metrics["memory/max_allocated_gib"] = float(gather(peak).max())
        return metrics

    # ------------------------------------------------------------------ evaluation and previews
    def preview(self, tag: str, prompts_shown: int = 4, samples_per_prompt: int = 2) -> Path | None:
        """A sample sheet of held-out prompts under previews/<tag> (evaluator.py)."""
        return self.heldout.preview(tag, prompts_shown, samples_per_prompt)

    def _evaluate_logged(self, logger: MetricsLogger) -> dict[str, float]:
        """The held-out evaluation (evaluator.py) logged as eval/...; when it fails, the logger and the
        scorers are closed first."""
        started = time.perf_counter()
        progress = {
            "train_seconds": self.trained_s,
            "generated_samples": self.sample_counts.get("generated", 0),
        }
        try:
            result = self.heldout.evaluate()
        except BaseException:
            logger.close()
            self.close_scorers()
            raise
        self.evaluating_s += time.perf_counter() - started
        logger.log({f"eval/{k}": v for k, v in {**result, **progress}.items()}, step=self.step)
        return result

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
        logger = open_run_log(
            self.cfg, self.output_dir, self.accelerator, self.step, self.rank, self.wandb_run_id
        )
        start = time.perf_counter()
        if cfg.train.eval_at_start_and_end and self.eval_before is None:
            self.eval_before = self._evaluate_logged(logger)
            if cfg.train.preview_every:
                self.preview(f"step_{self.step:05d}")
        evaluating_s = time.perf_counter() - start
        first_step, loop_start = self.step, time.perf_counter()
        self.loop_started, self.evaluating_s_at_loop = loop_start, self.evaluating_s
        if self.recheck is not None:
            startup_s = self.build_s + loop_start - self.built_at - evaluating_s  # what a restart costs
            self.recheck.loop_started(LoopStart(self.building_started_at, startup_s), cfg.execution)
        try:
            ends, switching = self._steps(logger)
        except BaseException:
            self.close_scorers()  # connections and the scoring thread; the error propagates
            raise
        if not cfg.train.checkpoint_every or self.step % cfg.train.checkpoint_every:
            self.save()
        summary: dict[str, Any] = {
            "steps": self.step,
            "steps_this_run": self.step - first_step,
            "seconds": round(time.perf_counter() - start, 2),
            **loop_speeds(loop_start, ends, cfg.data.prompts_per_step),
        }
        return self._finish(logger, summary, switching)

    def _steps(self, logger: MetricsLogger) -> tuple[list[float], bool]:
        """Train to train.steps, or until auto's re-check switches modes (True); each step's end."""
        cfg = self.cfg
        bar = tqdm(
            total=cfg.train.steps,
            initial=self.step,
            desc=self.algorithm.display_name,
            disable=not (cfg.train.progress and self.is_main),
        )
        place = ProcessPlace(self.rank, self.world_size, self.device, self.source.share_group)
        ends: list[float] = []
        switching = False  # auto: the re-check stops this mode here to resume in another
        try:
            while self.step < cfg.train.steps and not switching:
                metrics = self.train_step()
                ends.append(time.perf_counter() - (self.evaluating_s - self.evaluating_s_at_loop))  # no evals
                self.trained_s = self.trained_s_before + ends[-1] - self.loop_started  # at this step's end
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
                        plot_run_curve(self.output_dir)
                if cfg.train.checkpoint_every and self.step % cfg.train.checkpoint_every == 0:
                    self.save()
                last = self.step == cfg.train.steps and cfg.train.eval_at_start_and_end  # the end's evaluates
                if cfg.eval.every and self.step % cfg.eval.every == 0 and not last:
                    self._evaluate_logged(logger)
                if self.recheck is not None:  # the step's phases, its checkpoint (if any) saved
                    phases = StepPhases(self.step, *self.step_times, self.source.rollout_group_s, self.save_s)
                    switching = self.recheck.after_step(phases, place)
        finally:
            bar.close()
        return ends, switching

    def _finish(self, logger: MetricsLogger, summary: dict[str, Any], switching: bool) -> dict[str, Any]:
        """Stop the source, evaluate at the end, close everything; the run summary (written once)."""
        try:
            summary.update(self.source.finish())
        except BaseException:
            logger.close()
            self.close_scorers()
            raise
        if self.cfg.train.eval_at_start_and_end and not switching:  # a switch continues the run elsewhere
            after = self._evaluate_logged(logger)
            summary = {**before_after_summary(self.eval_before or {}, after, self.heldout.metrics), **summary}
        logger.close()
        self.close_scorers()
        summary["samples"] = dict(self.sample_counts)
        if self.is_main:
            plot_run_curve(self.output_dir)
            if self.recheck is None:  # under auto, its driver writes the whole run's summary once
                atomic_write_text(self.output_dir / "summary.json", json.dumps(summary, indent=1))
        return summary


def plot_run_curve(output_dir: Path) -> None:
    """The run's reward curve (reward_curve.png) from its metrics.jsonl."""
    plot_reward_curve(read_metrics(output_dir / "metrics.jsonl"), output_dir / "reward_curve.png")


def loop_speeds(loop_start: float, step_ends: list[float], prompts_per_step: int) -> dict[str, float]:
    """Seconds per trained prompt of the training loop alone (start-up, evaluation and saving
    excluded), and without the first step (async modes fill their buffer then)."""
    out = {}
    steps = len(step_ends)
    if steps:
        out["seconds_per_trained_prompt"] = round((step_ends[-1] - loop_start) / steps / prompts_per_step, 4)
    if steps > 1:
        steady = (step_ends[-1] - step_ends[0]) / (steps - 1) / prompts_per_step
        out["steady_seconds_per_trained_prompt"] = round(steady, 4)
    return out


def step_prompts(
    step: int, per_step: int, rank: int, world_size: int, prompt_at: Callable[[int], str]
) -> tuple[list[str], list[int]]:
    """Process `rank`'s prompts of `step` and their global group ids: its contiguous share of the
    step's positions of the data stream (`prompt_at`)."""
    local = per_step // world_size
    mine = range(rank * local, (rank + 1) * local)
    return [prompt_at(step * per_step + i) for i in mine], [step * per_step + i for i in mine]


def open_run_log(
    cfg: ExperimentConfig, output_dir: Path, accelerator: Any, step: int, rank: int, run_id: str
) -> MetricsLogger:
    """A run's metrics log (and wandb), its records past the resumed `step` dropped."""
    output_dir.mkdir(parents=True, exist_ok=True)
    if rank == 0:
        _truncate_metrics(output_dir / "metrics.jsonl", keep_until=step)
    _truncate_metrics(failures_path(output_dir, rank), keep_until=step)
    return MetricsLogger(
        output_dir,
        accelerator,
        use_wandb=cfg.tracking.wandb,
        project=cfg.tracking.project,
        run_name=cfg.tracking.run_name or output_dir.name,
        config=cfg.to_dict(),
        run_id=run_id,
        is_main_process=rank == 0,
    )


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
