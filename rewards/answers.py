"""Rewards for a language model's answers to questions from a question file (or tiny AVQA): each
reads `media.text` (the answers) and the data-stream prompt (the question's key, whose right answer
and options it carries), returns [B] in {0, 1}. They never open the files a key names, so they can be
served (`odrl serve-reward answer_exact choice_letter`) and used through `reward.url`.

- `answer_exact`: 1 when the normalised answer is the right one; for a multiple-choice question whose
  answer the file gives as a letter, also the option's text, or the letter alone (a letter alone is
  no answer where the file answers with the text: its options may be shown without letters).
- `choice_letter`: for a multiple-choice question, 1 when the option the answer picks (by letter,
  "the answer is B", or one option's text) is the right one; any other question it grades as
  `answer_exact` does, so that a file mixing both kinds trains with either reward or both.

A question without a right answer (a rubric-only line, for a judge), a prompt that names no question,
or a batch without text is an error, never a score of 0. A judge of rubric lines is a reward of your
own, registered and served the same way: it reads the question, the rubric and the answer from the
same key and text.
"""

from __future__ import annotations

import torch

from omni_diffusion_rl.answer_data.questions import (
    AskedQuestion,
    FileQuestion,
    answers_by_letter,
    chosen_letter,
    is_file_key,
    is_right,
    reference_letter,
)
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.world.avqa import parse_question


def asked_of(prompt: str) -> AskedQuestion:
    """What a prompt's answers are graded against (a rubric line is refused by name); an option's letter
    alone answers a question-file line whose answer is a letter, never a tiny AVQA question."""
    question = question_of(prompt)
    return _graded(question, letters=is_file_key(prompt) and answers_by_letter(question))


def question_of(prompt: str) -> FileQuestion:
    """The question a prompt names, as a question-file line (a tiny AVQA prompt is converted)."""
    if is_file_key(prompt):
        return FileQuestion.from_key(prompt)
    q = parse_question(prompt)
    return FileQuestion(question=q.text, answer=q.answer, choices=q.choices, category=q.kind)


def _answers(media: MediaBatch) -> list[str]:
    if media.text is None:
        raise ValueError("this reward scores answers: the media batch carries no text (MediaBatch.text)")
    return media.text


def _graded(question: FileQuestion, letters: bool = False) -> AskedQuestion:
    if question.answer is None:
        raise ValueError(
            f"the question {question.question[:80]!r} has no answer (a rubric line): grade it with a judge "
            "reward, not by matching"
        )
    return AskedQuestion(
        question.question, question.answer, question.category, choices=question.choices, letters=letters
    )


def _ungradable(prompt: str) -> str | None:
    """Why a prompt's answers cannot be graded by matching (`odrl train --check` asks before a run)."""
    try:
        question = question_of(prompt)
    except ValueError as e:
        return str(e)
    if question.answer is None:
        return "a rubric line (no answer to match): grade it with a judge reward, or drop the line"
    return None


@rewards.register("answer_exact")
class AnswerExactMatch:
    """1.0 for the right answer (normalised; or the right option's letter), else 0.0."""

    ungradable = staticmethod(_ungradable)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        answers = _answers(media)
        return torch.tensor([is_right(a, asked_of(p)) for a, p in zip(answers, prompts, strict=True)])


@rewards.register("choice_letter")
class ChoiceLetter:
    """1.0 when the answer picks the right option of a multiple-choice question (a question without
    choices: its exact answer), else 0.0."""

    ungradable = staticmethod(_ungradable)

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        out = []
        for answer, prompt in zip(_answers(media), prompts, strict=True):
            question = question_of(prompt)
            graded = asked_of(prompt)
            if not question.choices:
                out.append(is_right(answer, graded))
                continue
            right = reference_letter(question)
            out.append(float(chosen_letter(answer, question.choices) == right))
        return torch.tensor(out)
