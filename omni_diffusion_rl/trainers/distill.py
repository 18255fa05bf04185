"""On-policy distillation (algorithm.name=distill) on the shared update: the teacher's targets are
made with the experience (experience/teacher_targets.py), algorithms/distill.py holds the loss and
its weightings, algorithm_options.py the options. It reads DiffusionNFT's options too (nft_coef)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..algorithm_options import DistillOptions, check_distill
from ..algorithms.distill import distillation_loss, state_weights
from ..config import NO_TEACHER, ExperimentConfig
from ..experience.rollout import Rollout, step_generator
from ..experience.teacher_routes import TEACHER_MASK
from ..experience.teacher_targets import (
    COMPLETED,
    STATES,
    TEACHER_V,
    TEACHER_V_EMPTY,
    TEACHER_X0,
    TeacherTargets,
    make_checked_teacher,
)
from ..models.policy import index_condition
from ..registry import algorithms
from .learner import Learner
from .nft import DiffusionNFT
from .skeleton import (
    Algorithm,
    MicroBatch,
    Plan,
    UpdateBatch,
    Work,
    finite_if_dropped,
    micro_batches,
    split_at,
)


def trained_state_order(cfg: ExperimentConfig, rollout: Rollout, step: int) -> torch.Tensor:
    """[N, T]: each sample's states in a random order keyed by (seed, step, prompt group); the first
    timestep_fraction of them are trained."""
    steps, k = len(rollout.grid) - 1, cfg.data.group_size
    orders = []
    for start in range(0, len(rollout), k):
        gen = step_generator(cfg.train.seed, step, int(rollout.group_ids[start]), "train")
        orders += [torch.randperm(steps, generator=gen) for _ in range(min(k, len(rollout) - start))]
    return torch.stack(orders)


@algorithms.register("distill")
class OnPolicyDistillation(Algorithm):
    """On-policy distillation: the student samples its own trajectories (the rollout weights), a
    frozen teacher gives velocity targets on the states they visited (or on the student's x0
    forward-noised), made alongside generation (teacher_targets.py) and carried with each group;
    loss = weighted mean over states of mean_d (v_student - v_teacher)^2, plus nft_coef times the
    DiffusionNFT loss. With nft_coef 0 the rollout adapter follows the trained one every step.
    distill_target=contrast trains DiffusionNFT's loss alone, r = 1 on the teacher's completions and
    0 on the student's own samples (`contrast_pairs`). DiffusionNFT is a part (`self.nft`, reading
    the same section), not a parent: its plan, loss and schedule are asked for where they are used."""

    display_name = "distillation"
    options_type = DistillOptions
    uses_teacher = True  # teacher.one_step_off hides its time

    def __init__(self, learner: Learner) -> None:
        super().__init__(learner)
        self.nft = DiffusionNFT(learner)  # nft_coef > 0 and contrast train its loss; it sets the schedule

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_distill(cfg)

    @classmethod
    def experience_annotator(cls, cfg: ExperimentConfig, policy: Any, sharder: Any = None) -> Any:
        teacher = make_checked_teacher(cfg, policy, sharder)
        # A teacher sharded on GPUs answers on the main thread: its all-gathers and the policy's, on
        # two NCCL communicators from two threads, could interleave in another order on each
        # process, which NCCL does not allow (gloo on CPU does).
        c = cfg.teacher
        if c.routes:  # in process: any route with a teacher and no servers
            in_process = any(not r.get("urls") and r.get("name") != NO_TEACHER for r in c.routes.values())
        else:
            in_process = not c.urls
        nccl_shards = in_process and sharder is not None and sharder.active and sharder.device.type == "cuda"
        overlap = cfg.teacher.overlap and not nccl_shards
        a = cfg.algorithm
        return TeacherTargets(
            teacher,
            a.distill_states,
            cfg.train.seed,
            overlap=overlap,
            target=a.distill_target,
            completions=a.distill_completions,
            contrast_from=a.distill_contrast_from,
            same_forwards=in_process and sharder is not None and sharder.active,
            empty_prompt=a.distill_cond_coef > 0,
        )

    @property
    def contrast(self) -> bool:
        """distill_target=contrast: DiffusionNFT on teacher completions (positive) against the
        student's samples (negative), no velocity targets."""
        return self.options.distill_target == "contrast"

    def metric_names(self) -> list[str]:
        if self.contrast:
            return self.nft.metric_names()
        names = ["loss/distill", "loss/total"]
        if self.options.distill_cond_coef > 0:
            names.append("loss/distill_cond")
        if self.options.nft_coef > 0:
            names += [f"nft/{n}" for n in self.nft.metric_names()]
        return sorted(names)

    def plan(self, batch: UpdateBatch) -> Plan:
        order = trained_state_order(self.learner.cfg, batch.rollout, batch.step)  # by group, before drops
        if self.options.nft_coef > 0:
            plan = self.nft.nft_plan(batch.rollout, self.nft.optimality(batch), batch.step, batch.mine)
        else:
            plan = Plan(batch.mine, metrics={"old_decay": self.old_decay(batch.step)})
        plan.data["order"] = order
        return plan

    def update(self, batch: UpdateBatch) -> dict[str, float]:
        if not self.contrast:
            return super().update(batch)
        pairs, r = contrast_pairs(batch.rollout)
        plan = self.nft.nft_plan(pairs, r, batch.step, torch.cat([batch.mine, batch.mine]))
        return self.run(pairs, batch.step, plan)

    def gradients(self, work: Work) -> dict[str, float]:
        if self.contrast:
            return self.accumulate(self.sweep(work))
        sums: dict[str, float] = {}
        if self.options.nft_coef > 0:  # first: it needs no teacher targets, so the teacher gets more time
            nft = self.accumulate(self.sweep(replace(work, scale=self.options.nft_coef)))
            sums |= {f"nft/{k}": v for k, v in nft.items()}
        return sums | self.accumulate(self.distill_sweep(work), self.distill_loss)

    def summarize(self, work: Work, sums: dict[str, float]) -> dict[str, float]:
        if self.contrast:
            return sums
        distill = sums.setdefault("loss/distill", 0.0)
        sums["loss/total"] = distill + self.options.nft_coef * sums.get("nft/loss/total", 0.0)
        return sums

    def old_decay(self, step: int) -> float:
        return 0.0 if self.options.nft_coef == 0 and not self.contrast else self.nft.old_decay(step)

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """DiffusionNFT's loss (contrast, and the nft_coef part); the velocity matching is distill_loss."""
        return self.nft.loss(micro)

    def distill_sweep(self, work: Work) -> Iterator[MicroBatch]:
        """The trained states: the first timestep_fraction of each sample's `order` (completion
        targets: the states the teacher completed), sample-major in the order the chunks were made (a
        part whose teacher targets are still pending waits for them when reached), one pass per
        state."""
        rollout, cfg = work.rollout, self.learner.cfg
        if not len(rollout):
            return
        device = rollout.x0.device
        grid = rollout.grid.to(device)
        weights = state_weights(rollout.grid, self.options.distill_weighting).to(device)
        order = work.data["order"].to(device)
        num_train = max(1, int(order.shape[1] * cfg.algorithm.timestep_fraction))
        if self.options.distill_target == "completion":
            num_train = self.options.distill_completions
        parts = split_at(micro_batches(len(rollout), cfg.train.micro_batch_size), rollout.pending_bounds())
        for part in parts:
            row_weight = work.weight(part, device)
            taught = teacher_rows(rollout, part, device, row_weight, self.options.distill_cond_coef > 0)
            states, targets, answered, empty = taught.states, taught.targets, taught.answered, taught.empty
            rows = torch.arange(len(states), device=device)
            trained = (
                order[part] if taught.completed is None else completed_order(taught.completed, num_train)
            )
            cond = index_condition(rollout.cond, part)
            cond_empty = None if empty is None else self.empty_condition(len(states), device)
            for j in range(num_train):
                index = trained[:, j]
                weight = weights[index] if row_weight is None else weights[index] * row_weight
                data = {
                    "x": states[rows, index],
                    "t": grid[index],
                    "cond": cond,
                    "target": targets[rows, index],
                }
                if answered is not None:  # routes with no teacher: those entries are left alone
                    data["answered"] = answered
                if empty is not None:  # the teacher's velocity for "" at the same states
                    data |= {"target_empty": empty[rows, index], "cond_empty": cond_empty}
                yield MicroBatch(work, part, j, num_train, {**data, "weight": weight})

    def distill_loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        """Velocity matching at one state of each sample of the micro-batch."""
        d = micro.data
        with self.learner.autocast():
            v = self.learner.policy.velocity(d["x"], d["t"], d["cond"])
        focus, answered = self.options.distill_focus, d.get("answered")  # routes: the taught entries
        loss = distillation_loss(v.float(), d["target"], d["weight"], focus, answered)
        if "target_empty" not in d:
            return loss, {"loss/distill": loss.detach()}
        with self.learner.autocast():
            v_empty = self.learner.policy.velocity(d["x"], d["t"], d["cond_empty"])
        gap_s, gap_t = v.float() - v_empty.float(), d["target"] - d["target_empty"]
        cond_loss = distillation_loss(gap_s, gap_t, d["weight"], 0.0, answered)
        total = loss + self.options.distill_cond_coef * cond_loss
        return total, {"loss/distill": loss.detach(), "loss/distill_cond": cond_loss.detach()}

    def empty_condition(self, count: int, device: torch.device) -> dict[str, torch.Tensor]:
        """The student's condition for `count` empty prompts, on `device`."""
        cond = self.learner.policy.encode_prompts([""] * count)
        return {k: v.to(device) for k, v in cond.items()}


def contrast_pairs(rollout: Rollout) -> tuple[Rollout, torch.Tensor]:
    """The student's samples followed by the teacher's completions of them (the same prompts,
    groups and conditions; DiffusionNFT's noise and times are keyed by group, so each pair shares
    them), and r [2N]: 0 for the student's, 1 for the teacher's."""
    rollout = rollout.settle()
    if TEACHER_X0 not in rollout.extras:
        raise ValueError("a contrast rollout lacks the teacher's completions (made without a teacher?)")
    plain = Rollout(rollout.prompts, rollout.group_ids, rollout.x0, rollout.cond, rollout.grid)
    teacher = replace(plain, x0=rollout.extras[TEACHER_X0].to(rollout.x0.device, rollout.x0.dtype))
    r = torch.cat([torch.zeros(len(plain)), torch.ones(len(plain))])
    return Rollout.cat([plain, teacher]), r


def completed_order(completed: torch.Tensor, count: int) -> torch.Tensor:
    """[B, count]: the indices of each row's completed states ([B, T] bool, `count` true per row)."""
    per_row = completed.sum(dim=1)
    if not bool((per_row == count).all()):
        raise ValueError(
            f"completion targets were made for {sorted(set(per_row.tolist()))} states per sample, not "
            f"algorithm.distill_completions={count} (made with another setting?)"
        )
    return completed.nonzero(as_tuple=True)[1].view(len(completed), count)


@dataclass(frozen=True)
class TeacherRows:
    """A part's rows as distillation trains them: the states [B, T, ...] and the teacher's targets
    there, which entries a teacher answered [B, ...] (None: every one), which states have completion
    targets [B, T] (None: all) and the teacher's velocities for the empty prompt (None: not asked)."""

    states: torch.Tensor
    targets: torch.Tensor
    answered: torch.Tensor | None
    completed: torch.Tensor | None
    empty: torch.Tensor | None


def teacher_rows(
    rollout: Rollout, part: slice, device: torch.device, weight: torch.Tensor | None, empty: bool = False
) -> TeacherRows:
    """Rows `part` of a distillation rollout (waiting for them while their chunk's targets are
    pending), zeroed where `weight` is 0; `empty`: also the teacher's empty-prompt velocities
    (algorithm.distill_cond_coef), an error when the rollout lacks them."""
    extras = rollout.extras_rows(part)
    missing = [k for k in (STATES, TEACHER_V, *([TEACHER_V_EMPTY] if empty else [])) if k not in extras]
    if missing:
        lacks = ", ".join(missing)
        raise ValueError(
            f"a distillation rollout lacks {lacks} (made without a teacher, or with another "
            "algorithm.distill_cond_coef?)"
        )

    def moved(key: str) -> torch.Tensor | None:
        return None if key not in extras else extras[key].to(device)

    return TeacherRows(
        finite_if_dropped(extras[STATES].to(device), weight),
        finite_if_dropped(extras[TEACHER_V].to(device), weight),
        moved(TEACHER_MASK),
        moved(COMPLETED),
        finite_if_dropped(extras[TEACHER_V_EMPTY].to(device), weight) if empty else None,
    )
