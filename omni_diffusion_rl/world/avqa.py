"""Tiny audio-visual question answering over tiny-world clips: the autoregressive (GSPO) side's task.

Each question asks about one thing a clip shows or sounds: its colour, its shape, the tone's pitch,
or when the tone sounds, as multiple choice (the options are listed; the answer is one option's
word, as in AVQA), or asks for a short description of the whole clip (the answer is the scene's
prompt, e.g. "a red circle with a high tone at the start"). Questions are answered from the clip
alone: the question never names the scene. The held-out split asks about the held-out scenes of the
diffusion side (`HELDOUT_PROMPTS`), so neither side trains on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..answer_data.questions import AskedQuestion, normalise_answer
from ..answer_data.style import PLAIN
from ..registry import question_sets
from .tiny_clip import synthesize_audio
from .tiny_world import (
    ALL_SCENES,
    ATTRIBUTE_OPTIONS,
    HELDOUT_PROMPTS,
    SCENE_BY_PROMPT,
    WHEN_PHRASES,
    Scene,
    render_scene,
)

WHEN_ANSWERS = {"early": "start", "late": "end"}  # the word a timing answer uses
QUESTION_KINDS = ("color", "shape", "pitch", "when", "describe")
_ASK = {
    "color": "what colour is the shape",
    "shape": "which shape is shown",
    "pitch": "is the tone low mid or high",
    "when": "does the tone sound at the start or at the end",
}


@dataclass(frozen=True)
class Question:
    scene: Scene
    kind: str

    @property
    def question(self) -> str:
        """The question alone, without its options (what a question file's line holds)."""
        return "describe the clip" if self.kind == "describe" else f"{_ASK[self.kind]} ?"

    @property
    def text(self) -> str:
        """The question as the model reads it: multiple choice lists the options, in the default
        style of a question file's lines (answer_data/style.py), so both read alike."""
        return PLAIN.text(self.question, self.choices)

    @property
    def choices(self) -> tuple[str, ...]:
        """The options a multiple-choice question lists (a description lists none)."""
        return () if self.kind == "describe" else answer_options(self.kind)

    @property
    def answer(self) -> str:
        """The one right answer."""
        if self.kind == "describe":
            return self.scene.prompt
        if self.kind == "when":
            return WHEN_ANSWERS[self.scene.when]
        return str(getattr(self.scene, self.kind))


def answer_options(kind: str) -> tuple[str, ...]:
    """The options a multiple-choice question lists."""
    if kind == "when":
        return tuple(WHEN_ANSWERS.values())
    return ATTRIBUTE_OPTIONS[kind]


def exact_match(answer: str, question: Question) -> float:
    """1.0 when the normalised answer is the right one, else 0.0."""
    return float(normalise_answer(answer) == normalise_answer(question.answer))


def split_scenes(heldout: bool) -> list[Scene]:
    """The scenes of the training split, or the held-out ones (the diffusion side's held-out)."""
    held = set(HELDOUT_PROMPTS)
    return [s for s in ALL_SCENES if (s.prompt in held) == heldout]


def questions(heldout: bool, kinds: tuple[str, ...] = QUESTION_KINDS) -> list[Question]:
    """Every question of a split: each scene asked each kind, in a fixed order."""
    unknown = sorted(set(kinds) - set(QUESTION_KINDS))
    if unknown:
        raise ValueError(f"unknown question kinds {unknown}; use {', '.join(QUESTION_KINDS)}")
    return [Question(scene, kind) for scene in split_scenes(heldout) for kind in kinds]


def vocabulary() -> list[str]:
    """Every word the questions and answers use (sorted): the tiny omni tokenizer's words."""
    words: set[str] = set()
    for heldout in (False, True):
        for q in questions(heldout):
            words.update(q.text.split())
            words.update(q.answer.split())
    return sorted(words)


def render_clips(batch: list[Question], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The clips the questions ask about: video [B, F, 3, H, W] and audio amplitudes [B, frames, bins]
    (a fresh placement of the shape per clip, drawn from `gen`)."""
    rendered = [render_scene(q.scene, gen) for q in batch]
    return torch.stack([v for v, _ in rendered]), torch.stack([a for _, a in rendered])


def when_phrase(answer_word: str) -> str:
    """The prompt phrase of a timing answer word ("start" -> "at the start")."""
    inverse = {v: k for k, v in WHEN_ANSWERS.items()}
    return WHEN_PHRASES[inverse[answer_word]]


def question_prompt(question: Question) -> str:
    """The data stream's name of a question: "<kind> | <scene prompt>" (the model never sees it; it
    reads the clip and `question.text`)."""
    return f"{question.kind} | {question.scene.prompt}"


def parse_question(prompt: str) -> Question:
    """The question a data-stream prompt names; anything else is refused with the expected form.
    The scene must be a tiny-world prompt as the world writes it (surrounding whitespace aside): a
    look-up, in time linear in the prompt's length."""
    kind, sep, scene_text = prompt.partition(" | ")
    scene = SCENE_BY_PROMPT.get(scene_text.strip()) if sep else None
    if kind not in QUESTION_KINDS or scene is None:
        shown = prompt if len(prompt) <= 200 else f"{prompt[:200]}... ({len(prompt)} characters)"
        raise ValueError(
            f"{shown!r} is not a tiny AVQA prompt: expected '<kind> | <tiny-world prompt>' with kind one of "
            f"{', '.join(QUESTION_KINDS)}, e.g. 'color | a red circle with a high tone at the start'"
        )
    return Question(scene, kind)


TRAIN_QUESTIONS = [question_prompt(q) for q in questions(heldout=False)]
HELDOUT_QUESTIONS = [question_prompt(q) for q in questions(heldout=True)]


@question_sets.register("tiny_avqa")
class TinyAVQAQuestions:
    """Tiny AVQA as a question set (data.questions=tiny_avqa): a prompt "<kind> | <scene>" names a
    question, asked about a clip of the scene rendered fresh from the generator."""

    def ask(self, prompt: str, gen: torch.Generator) -> AskedQuestion:
        return asked_question(prompt, gen)

    def text(self, prompt: str) -> str:
        return parse_question(prompt).text


def asked_question(prompt: str, gen: torch.Generator) -> AskedQuestion:
    """The question a tiny AVQA prompt names, on a fresh clip drawn from `gen`."""
    question = parse_question(prompt)
    video, amps = render_clips([question], gen)
    return AskedQuestion(
        text=question.text,
        reference=question.answer,
        category=question.kind,
        video=video[0],
        audio=synthesize_audio(amps)[0],
        choices=question.choices,
        letters=False,  # its options are listed without letters
    )
