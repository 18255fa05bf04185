"""GSPO on the shared loop: the autoregressive path's algorithm (algorithms/gspo.py holds the math).

The rollout side samples answers with the `old` adapter and records their log-probs; the update
recomputes them with the trained adapter, takes group-normalised advantages over the whole step and
the clipped sequence-ratio loss against the recorded (behaviour) log-probs, then copies the trained
adapter into `old` (on-policy: the next step samples with what was just trained). In the async modes
the answers may be a few versions old; the ratio against their behaviour log-probs accounts for it.
"""

from __future__ import annotations

from typing import Any

import torch

from ..algorithm_options import STD_CORRECTIONS, GSPOOptions, check_gspo
from ..algorithms.gspo import policy_loss
from ..config import ExperimentConfig
from ..experience.text_sampling import selected_prompts
from ..registry import algorithms
from .skeleton import Algorithm, MicroBatch, Plan, UpdateBatch, Work

STAT_NAMES = ("clip_fraction", "ratio_mean", "ratio_max_dev")


@algorithms.register("gspo")
class GroupSequencePolicyOptimization(Algorithm):
    """GSPO (or GRPO's token ratio, `algorithm.ratio_level=token`) for an answering policy."""

    display_name = "GSPO"
    options_type = GSPOOptions
    experience_kind = "answers"

    @classmethod
    def check(cls, cfg: ExperimentConfig) -> None:
        check_gspo(cfg)

    def metric_names(self) -> list[str]:
        answers = ["answers/mean_tokens", "answers/truncated"]  # of the trained answers, in every mode
        return ["loss/gspo", "loss/total", "gspo/logp_gap", *(f"gspo/{n}" for n in STAT_NAMES), *answers]

    def plan(self, batch: UpdateBatch) -> Plan:
        advantages = batch.advantages(
            per_group_std=True, std_correction=STD_CORRECTIONS[self.options.adv_std]
        )
        return Plan(batch.mine, {"advantages": advantages[batch.local]})

    def loss(self, micro: MicroBatch) -> tuple[torch.Tensor, dict[str, Any]]:
        a, learner = self.options, self.learner
        model = learner.policy.model
        device = next(model.parameters()).device
        sub = micro.work.rollout.select(torch.arange(micro.part.start, micro.part.stop)).to(device)
        with learner.autocast():
            prompted = group_prompts(model, sub)
            logp = model.answer_log_probs(
                prompted, sub.answers, sub.answer_mask, a.temperature, a.min_new_tokens
            )
        advantages = micro.rows("advantages").to(device)
        loss, stats = policy_loss(
            logp,
            sub.behaviour_logp,
            advantages,
            sub.answer_mask,
            a.clip_eps_low,
            a.clip_eps_high,
            a.ratio_level,
        )
        metrics = {
            "loss/gspo": loss.detach(),
            "loss/total": loss.detach(),
            "gspo/logp_gap": logp_gap(logp, sub),
        }
        return loss, metrics | {f"gspo/{name}": stats[name] for name in STAT_NAMES}

    def summarize(self, work: Work, sums: dict[str, float]) -> dict[str, float]:
        kept = work.rollout
        if len(kept):  # what the rollout side sampled: measured here, so the async modes log it too
            sums["answers/mean_tokens"] = float(kept.answer_mask.sum(-1).float().mean())
            sums["answers/truncated"] = float(kept.truncated.float().mean())
        return sums


def group_prompts(model: Any, answers: Any) -> Any:
    """The prompts of a micro-batch's answers (a TextRollout's rows), built once per prompt group (one
    clip and question a group) and selected for each answer: the towers run once per clip, not once
    per answer (text_sampling.selected_prompts)."""
    groups, first = answers.group_ids.tolist(), {}
    for row, group in enumerate(groups):
        first.setdefault(group, row)
    ids = answers.question_ids()
    unique = list(first.values())
    if len(unique) == len(groups):
        return model.prompt(answers.video, answers.audio, ids)
    at = torch.tensor(unique, device=answers.video.device)
    position = {group: i for i, group in enumerate(first)}
    index = torch.tensor([position[g] for g in groups])
    return selected_prompts(model, answers.video[at], answers.audio[at], [ids[i] for i in unique], index)


def logp_gap(logp: torch.Tensor, answers: Any) -> float:
    """Mean |log pi_theta - log pi_behaviour| over the answers' tokens (a TextRollout's): how far the
    trained policy has moved from the one that sampled them."""
    mask = answers.answer_mask
    return float((logp.detach() - answers.behaviour_logp)[mask].abs().mean()) if mask.any() else 0.0
