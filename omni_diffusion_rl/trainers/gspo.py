"""GSPO on the shared loop: the autoregressive path's algorithm (algorithms/gspo.py holds the math).

The rollout side samples answers with the `old` adapter and records their log-probs; the update
recomputes them with the trained adapter, takes group-normalised advantages over the whole step and
the clipped sequence-ratio loss against the recorded (behaviour) log-probs, then copies the trained
adapter into `old` (on-policy: the next step samples with what was just trained). In the async modes
the answers may be a few versions old; the ratio against their behaviour log-probs accounts for it.
"""

from __future__ import annotations

import torch

from ..algorithms.advantages import STD_CORRECTIONS, group_advantages
from ..algorithms.gspo import policy_loss
from ..algorithms.soft_update import old_adapter_decay
from ..config import GSPOConfig
from ..models import lora
from ..registry import algorithms
from .algorithms import Algorithm, micro_batches

STAT_NAMES = ("clip_fraction", "ratio_mean", "ratio_max_dev")


@algorithms.register("gspo")
class GroupSequencePolicyOptimization(Algorithm):
    """GSPO (or GRPO's token ratio, `algorithm.ratio_level=token`) for an answering policy."""

    display_name = "GSPO"
    options_type = GSPOConfig
    trains_answers = True

    def metric_names(self) -> list[str]:
        answers = ["answers/mean_tokens", "answers/truncated"]  # of the trained answers, in every mode
        return ["loss/gspo", "loss/total", "gspo/logp_gap", *(f"gspo/{n}" for n in STAT_NAMES), *answers]

    def update(
        self,
        rollout,  # noqa: ANN001 - a TextRollout (text_rollout.py)
        rewards: torch.Tensor,
        groups: torch.Tensor,
        keep: torch.Tensor,
        local: slice,
        step: int,
    ) -> dict[str, float]:
        a, learner = self.options, self.learner
        model = learner.policy.model
        advantages = torch.zeros(len(rewards))
        correction = STD_CORRECTIONS[a.adv_std]
        advantages[keep] = group_advantages(
            rewards[keep], groups[keep], per_group_std=True, std_correction=correction
        )
        mine = keep[local]
        index = mine.nonzero().flatten()
        kept = rollout if bool(mine.all()) else rollout.select(index)
        adv = advantages[local][index]
        device = next(model.parameters()).device
        learner.begin_update(len(kept), len(kept))
        sums = dict.fromkeys(self.loss_metric_names(), 0.0)
        for part in micro_batches(len(kept), learner.cfg.train.micro_batch_size):
            share = (part.stop - part.start) / len(kept)
            sub = kept.select(torch.arange(part.start, part.stop)).to(device)
            with learner.autocast():
                prompted = model.prompt(sub.video, sub.audio, sub.question_ids())
                logp = model.answer_log_probs(
                    prompted, sub.answers, sub.answer_mask, a.temperature, a.min_new_tokens
                )
            mask = sub.answer_mask
            loss, stats = policy_loss(
                logp,
                sub.behaviour_logp,
                adv[part].to(device),
                mask,
                a.clip_eps_low,
                a.clip_eps_high,
                a.ratio_level,
            )
            learner.backward(loss * share)
            gap = float((logp.detach() - sub.behaviour_logp)[mask].abs().mean()) if mask.any() else 0.0
            for name, value in {"loss/gspo": float(loss.detach()), "gspo/logp_gap": gap}.items():
                sums[name] += value * share
            for name in STAT_NAMES:
                sums[f"gspo/{name}"] += stats[name] * share
        sums["loss/total"] = sums["loss/gspo"]
        if len(kept):  # what the rollout side sampled: measured here, so the async modes log it too
            sums["answers/mean_tokens"] = float(kept.answer_mask.sum(-1).float().mean())
            sums["answers/truncated"] = float(kept.truncated.float().mean())
        out = learner.weighted_mean_over_ranks(sums, float(len(kept)), self.loss_metric_names())
        learner.apply_gradients(out, weight=float(len(kept)))
        lora.soft_update_old(learner.transformer, old_adapter_decay("copy", step + 1))
        return out
