"""Rewards for a language model's answers to tiny AVQA questions: each reads `media.text` (the
answers) and the data-stream prompt ("<kind> | <scene>"), returns [B] in [0, 1].

- `avqa_exact`: 1 when the normalised answer is exactly the right one (AVQA's binary exact match
  of the chosen option; for a description, the whole scene phrase), else 0.
- `answer_format`: 1 when the answer has the question's form (one of the listed options for a
  multiple-choice question; "a <colour> <shape> with a <pitch> tone at the <start|end>" for a
  description), whatever its content: a format reward cannot be raised by being right.

A batch without text, or prompts that are not tiny AVQA prompts, is an error (never a score of 0).
"""

from __future__ import annotations

import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.world.avqa import answer_options, exact_match, normalise_answer, parse_question
from omni_diffusion_rl.world.tiny_world import COLORS, PITCH_BINS, SHAPES
from rewards.tiny_world import TINY_CLIP_LIMITS

# A description, word by word: the options of each word.
_DESCRIPTION = (
    ("a",),
    tuple(COLORS),
    SHAPES,
    ("with",),
    ("a",),
    tuple(PITCH_BINS),
    ("tone",),
    ("at",),
    ("the",),
    ("start", "end"),
)


def is_description(text: str) -> bool:
    """A normalised answer of the form "a <colour> <shape> with a <pitch> tone at the <start|end>"."""
    words = text.split(" ")
    if len(words) != len(_DESCRIPTION):
        return False
    return all(word in options for word, options in zip(words, _DESCRIPTION, strict=True))


def _answers(media: MediaBatch) -> list[str]:
    if media.text is None:
        raise ValueError("this reward scores answers: the media batch carries no text (MediaBatch.text)")
    return media.text


@rewards.register("avqa_exact")
class AVQAExactMatch:
    """1.0 for the exact right answer (case, spaces and punctuation normalised), else 0.0."""

    input_limits = TINY_CLIP_LIMITS  # it reads only the answers; its clips are tiny-world clips

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        answers = _answers(media)
        return torch.tensor(
            [exact_match(a, parse_question(p)) for a, p in zip(answers, prompts, strict=True)]
        )


@rewards.register("answer_format")
class AnswerFormat:
    """1.0 when the answer has the question's form (an option, or a scene description), else 0.0."""

    input_limits = TINY_CLIP_LIMITS

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        out = []
        for answer, prompt in zip(_answers(media), prompts, strict=True):
            kind, text = parse_question(prompt).kind, normalise_answer(answer)
            ok = is_description(text) if kind == "describe" else text in answer_options(kind)
            out.append(float(ok))
        return torch.tensor(out)
