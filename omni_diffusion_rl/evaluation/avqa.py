"""Held-out accuracy of an answering model on tiny AVQA: exact answers, greedy and sampled, overall
and per question kind. Clips and sampling noise are keyed by the seed, so two models are compared on
the same clips and the same random numbers."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..experience.rollout import step_generator
from ..experience.text_sampling import sample_answers
from ..media import MediaBatch, save_previews
from ..models.tiny_omni import TinyOmniModel
from ..world.avqa import Question, exact_match, parse_question, questions, render_clips
from ..world.tiny_clip import FPS, SAMPLE_RATE, synthesize_audio


@torch.no_grad()
def answer_questions(
    model: TinyOmniModel,
    batch: list[Question],
    seed: int,
    greedy: bool,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The model's answers to `batch` and the clips they are about (video, waveform): each clip and
    sampling stream keyed by (seed, position)."""
    gens = [step_generator(seed, 0, i, "eval") for i in range(len(batch))]
    rendered = [render_clips([q], g) for q, g in zip(batch, gens, strict=True)]
    video, amps = torch.cat([v for v, _ in rendered]), torch.cat([a for _, a in rendered])
    audio = synthesize_audio(amps)
    device = next(model.parameters()).device
    prompted = model.prompt(video.to(device), audio.to(device), model.tokenize([q.text for q in batch]))
    out = sample_answers(
        model.lm,
        prompted.embeds,
        prompted.mask,
        model.eos_id,
        model.pad_id,
        max_new_tokens,
        temperature,
        greedy=greedy,
        generators=None if greedy else gens,
    )
    texts = [
        model.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(out.tokens, out.mask, strict=True)
    ]
    return texts, video, audio


def avqa_accuracy(
    model: TinyOmniModel,
    pool: list[Question] | None = None,
    repeats: int = 4,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> dict[str, float]:
    """{greedy, sampled, greedy/<kind>, sampled/<kind>}: the share of exact answers over `pool`
    (default: every held-out question), each asked `repeats` times on fresh clips."""
    pool = [q for q in (questions(heldout=True) if pool is None else pool) for _ in range(repeats)]
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        for mode in ("greedy", "sampled"):
            answers, _, _ = answer_questions(model, pool, seed, mode == "greedy", max_new_tokens)
            by_kind: dict[str, list[float]] = defaultdict(list)
            for q, a in zip(pool, answers, strict=True):
                by_kind[q.kind].append(exact_match(a, q))
            scores = [s for v in by_kind.values() for s in v]
            out[mode] = sum(scores) / len(scores)
            out |= {f"{mode}/{k}": sum(v) / len(v) for k, v in sorted(by_kind.items())}
    finally:
        model.train(was_training)
    return out


class TinyAVQAEvaluation:
    """The held-out evaluation of an answering model on tiny AVQA (registered for model.family
    tiny_omni in registry.evaluations): exact-answer accuracy and the training reward of its greedy
    answers, and a preview of questions, clips and answers."""

    def __init__(self, cfg: Any, policy: Any, reward: Any, eval_prompts: list[str]) -> None:
        self.cfg, self.model, self.reward, self.eval_prompts = cfg, policy.model, reward, eval_prompts

    def evaluate(self) -> dict[str, float]:
        """Held-out exact-answer accuracy, greedy and sampled (accuracy/...), and the training reward
        of the greedy answers (reward, reward/...): the same questions, clips and random numbers at
        every evaluation. Every process computes it whole (it is small)."""
        per_question = max(1, self.cfg.data.eval_samples // len(self.eval_prompts))
        pool = [parse_question(p) for p in self.eval_prompts]
        seed, limit = self.cfg.train.seed, self.cfg.algorithm.max_new_tokens
        accuracy = avqa_accuracy(self.model, pool, per_question, seed, limit)
        chosen = [q for q in pool for _ in range(per_question)]
        answers, video, audio = answer_questions(self.model, chosen, seed, True, limit)
        prompts = [p for p in self.eval_prompts for _ in range(per_question)]
        media = MediaBatch(video=video, audio=audio, fps=FPS, sample_rate=SAMPLE_RATE, text=answers)
        scored = self.reward(media, prompts)
        out = {f"accuracy/{k}": v for k, v in accuracy.items()}
        out["reward"] = float(scored.total.mean())
        out |= {f"reward/{k}": float(v.mean()) for k, v in scored.parts.items()}
        return out

    def preview(self, folder: Path, shown: int) -> Path:
        """Held-out questions with their clips and the model's greedy answers side by side (the
        sheet's title per clip: question, answer, the right answer), written to `folder`."""
        n = len(self.eval_prompts)
        stride = max(1, n // shown)  # spread over the set, stepping one more each time to vary the kind
        chosen = [parse_question(self.eval_prompts[(i * stride + i) % n]) for i in range(min(shown, n))]
        answers, video, audio = answer_questions(self.model, chosen, 0, greedy=True)
        pairs = list(zip(chosen, answers, strict=True))
        titles = [f"Q: {q.text} | A: {a or '(empty)'} | right: {q.answer}" for q, a in pairs]
        right = [exact_match(a, q) for q, a in pairs]
        media = MediaBatch(video=video, audio=audio, fps=FPS, sample_rate=SAMPLE_RATE, text=answers)
        save_previews(folder, media, titles, {"avqa_exact": right})
        return folder
