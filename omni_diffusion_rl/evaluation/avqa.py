"""Held-out accuracy of an answering model: right answers, greedy and sampled, overall and per
category (a tiny AVQA question's kind, a question file's `category`). Clips and sampling noise are
keyed by the seed, so two models are compared on the same clips and the same random numbers. The
questions come from tiny AVQA or a question file alike (experience/text_rollout.ask)."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from ..answer_data.questions import AskedQuestion, is_right
from ..answer_data.style import PLAIN, QuestionStyle
from ..experience.rollout import step_generator
from ..experience.text_rollout import DEFAULT_QUESTIONS, ask
from ..experience.text_sampling import sample_answers
from ..media import MediaBatch, save_previews
from ..models.tiny_omni import TinyOmniModel


@torch.no_grad()
def answer_questions(
    model: TinyOmniModel,
    prompts: list[str],
    seed: int,
    greedy: bool,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
    questions: str = DEFAULT_QUESTIONS,
    style: QuestionStyle = PLAIN,
) -> tuple[list[str], list[AskedQuestion], torch.Tensor, torch.Tensor]:
    """The model's answers to the questions `prompts` name (question-file keys, or prompts of the
    registered question set `questions`), the questions as asked, and the clips they are about
    (video, waveform): each clip and sampling stream keyed by (seed, position). A model that sets
    `answer_batch` answers that many questions at a time (a real model's memory), the rest all at
    once."""
    gens = [step_generator(seed, 0, i, "eval") for i in range(len(prompts))]
    asked = [ask(p, g, model.clip_format, questions, style) for p, g in zip(prompts, gens, strict=True)]
    video, audio = model.clip_tensors(asked)
    size = getattr(model, "answer_batch", None) or len(prompts)
    texts: list[str] = []
    for at in range(0, len(prompts), size):
        part = slice(at, at + size)
        texts += _answer(
            model, asked[part], video[part], audio[part], gens[part], greedy, max_new_tokens, temperature
        )
    return texts, asked, video, audio


def _answer(
    model: TinyOmniModel,
    asked: list[AskedQuestion],
    video: torch.Tensor,
    audio: torch.Tensor,
    gens: list[torch.Generator],
    greedy: bool,
    max_new_tokens: int,
    temperature: float,
) -> list[str]:
    device = next(model.parameters()).device
    prompted = model.prompt(video.to(device), audio.to(device), model.tokenize([q.text for q in asked]))
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
        **model.sampling_options(prompted),
    )
    return [
        model.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(out.tokens, out.mask, strict=True)
    ]


def avqa_accuracy(
    model: TinyOmniModel,
    prompts: list[str],
    repeats: int = 4,
    seed: int = 0,
    max_new_tokens: int = 16,
    questions: str = DEFAULT_QUESTIONS,
    style: QuestionStyle = PLAIN,
) -> dict[str, float]:
    """{greedy, sampled, greedy/<category>, sampled/<category>}: the share of right answers over the
    questions `prompts` name that have a right answer, each asked `repeats` times (a tiny AVQA
    question on fresh clips)."""
    pool = [p for p in prompts for _ in range(repeats)]
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        for mode in ("greedy", "sampled"):
            greedy = mode == "greedy"
            answers, asked, _, _ = answer_questions(
                model, pool, seed, greedy, max_new_tokens, 1.0, questions, style
            )
            by_kind: dict[str, list[float]] = defaultdict(list)
            for q, a in zip(asked, answers, strict=True):
                if q.reference is not None:
                    by_kind[q.category].append(is_right(a, q))
            scores = [s for v in by_kind.values() for s in v]
            if not scores:
                raise ValueError("none of the held-out questions has a right answer: accuracy is undefined")
            out[mode] = sum(scores) / len(scores)
            out |= {f"{mode}/{k}": sum(v) / len(v) for k, v in sorted(by_kind.items())}
    finally:
        model.train(was_training)
    return out


def evaluate_answering(
    model: TinyOmniModel,
    prompts: list[str],
    reward: Any,
    samples: int,
    seed: int,
    max_new_tokens: int,
    questions: str = DEFAULT_QUESTIONS,
    style: QuestionStyle = PLAIN,
) -> dict[str, float]:
    """Held-out accuracy, greedy and sampled (accuracy/...), and the reward of the greedy answers
    (reward, reward/...; skipped when `reward` is None), about `samples` answers over `prompts`: the
    same questions, clips and random numbers at every call."""
    per_question = max(1, samples // len(prompts))
    accuracy = avqa_accuracy(model, prompts, per_question, seed, max_new_tokens, questions, style)
    out = {f"accuracy/{k}": v for k, v in accuracy.items()}
    if reward is None:
        return out
    chosen = [p for p in prompts for _ in range(per_question)]
    answers, _, video, audio = answer_questions(
        model, chosen, seed, True, max_new_tokens, 1.0, questions, style
    )
    clip = model.clip_format
    media = MediaBatch(video=video, audio=audio, fps=clip.fps, sample_rate=clip.sample_rate, text=answers)
    scored = reward(media, chosen)
    out["reward"] = float(scored.total.mean())
    out |= {f"reward/{k}": float(v.mean()) for k, v in scored.parts.items()}
    return out


class TinyAVQAEvaluation:
    """The held-out evaluation of an answering model (registered in registry.evaluations by entry
    points for model.family tiny_omni, qwen2_5_omni and qwen3_omni) on a question set's or a question
    file's held-out questions: right-answer accuracy and the training reward of its greedy answers,
    and a preview of questions, clips and answers."""

    def __init__(self, cfg: Any, policy: Any, reward: Any, eval_prompts: list[str]) -> None:
        self.cfg, self.model, self.reward, self.eval_prompts = cfg, policy.model, reward, eval_prompts

    def evaluate(self) -> dict[str, float]:
        """Held-out exact-answer accuracy, greedy and sampled (accuracy/...), and the training reward
        of the greedy answers (reward, reward/...): the same questions, clips and random numbers at
        every evaluation. Every process computes it whole (it is small)."""
        return evaluate_answering(
            self.model,
            self.eval_prompts,
            self.reward,
            self.cfg.data.eval_samples,
            self.cfg.train.seed,
            self.cfg.algorithm.max_new_tokens,
            self.cfg.data.questions,
            QuestionStyle.of(self.cfg.data),
        )

    def preview(self, folder: Path, shown: int) -> Path:
        """Held-out questions with their clips and the model's greedy answers side by side (the
        sheet's title per clip: question, answer, the right answer), written to `folder`."""
        n = len(self.eval_prompts)
        stride = max(1, n // shown)  # spread over the set, stepping one more each time to vary the kind
        chosen = [self.eval_prompts[(i * stride + i) % n] for i in range(min(shown, n))]
        questions = self.cfg.data.questions
        answers, asked, video, audio = answer_questions(
            self.model, chosen, 0, True, questions=questions, style=QuestionStyle.of(self.cfg.data)
        )
        pairs = list(zip(asked, answers, strict=True))
        titles = [f"Q: {q.text} | A: {a or '(empty)'} | right: {q.reference or '(judged)'}" for q, a in pairs]
        right = [is_right(a, q) if q.reference is not None else float("nan") for q, a in pairs]
        clip = self.model.clip_format
        media = MediaBatch(video=video, audio=audio, fps=clip.fps, sample_rate=clip.sample_rate, text=answers)
        save_previews(folder, media, titles, {"right": right})
        return folder
