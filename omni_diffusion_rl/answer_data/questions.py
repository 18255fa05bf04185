"""What an answering model is asked: a question about a clip, with its right answer when there is one.

A question from a file (question_file.py) travels through the run as its key: the line's fields in
canonical JSON, paths resolved. The key is the data stream's prompt, so it crosses the replay buffer
and the process boundaries as text, and every reward reads the right answer from it without a table.
Keys are parsed with a size and a nesting bound, and only the fields below are accepted.
"""

from __future__ import annotations

import json
import string
from dataclasses import asdict, dataclass, field

import torch

from .clip_files import ClipFormat, decode_audio, decode_video

MAX_KEY_CHARS = 16384
MAX_TEXT_CHARS = 2000
MAX_CHOICES = 26
LETTERS = string.ascii_uppercase


@dataclass(frozen=True)
class AskedQuestion:
    """A question as the model reads it, the clip it is about, and how it is graded.

    video: [F, 3, H, W] in [0, 1] or None; audio: [C, S] in [-1, 1] or None. `reference`: the right
    answer (None: graded by a judge only). `category`: what held-out accuracy is broken down by."""

    text: str
    reference: str | None
    category: str
    video: torch.Tensor | None = field(default=None, repr=False)
    audio: torch.Tensor | None = field(default=None, repr=False)
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class FileQuestion:
    """One line of a question file, its media paths resolved (see question_file.py for the format)."""

    question: str
    video: str | None = None
    audio: str | None = None
    answer: str | None = None
    choices: tuple[str, ...] = ()
    rubric: str | None = None
    category: str = "all"

    def key(self) -> str:
        """The data stream's prompt for this question: its fields as canonical JSON."""
        fields = {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(self).items() if v or v == ""
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    @classmethod
    def from_key(cls, key: str) -> FileQuestion:
        """The question a key names; anything else is refused by name."""
        if not is_file_key(key):
            raise ValueError(f"{_shown(key)} is not a question-file key (a JSON object)")
        if len(key) > MAX_KEY_CHARS:
            raise ValueError(f"a question-file key of {len(key)} characters is over {MAX_KEY_CHARS}")
        try:
            raw = json.loads(key)
        except json.JSONDecodeError as e:
            raise ValueError(f"{_shown(key)} is not valid JSON ({e.msg})") from e
        return cls(**checked_fields(raw, cls.__dataclass_fields__))

    def asked(self, clip: ClipFormat) -> AskedQuestion:
        """The question with its clip decoded at `clip`'s format."""
        return AskedQuestion(
            text=self.question,
            reference=self.answer,
            category=self.category,
            video=None if self.video is None else decode_video(self.video, clip),
            audio=None if self.audio is None else decode_audio(self.audio, clip),
            choices=self.choices,
        )


def checked_fields(raw: object, allowed: object) -> dict[str, object]:
    """A question's fields with their types checked (strings, a list of strings for choices)."""
    if not isinstance(raw, dict):
        raise ValueError(f"a question is a JSON object; got {type(raw).__name__}")
    unknown = sorted(set(raw) - set(allowed))  # type: ignore[arg-type]
    if unknown:
        raise ValueError(f"unknown fields {unknown}; a question has {', '.join(allowed)}")  # type: ignore[arg-type]
    out: dict[str, object] = {}
    for name, value in raw.items():
        if name == "choices":
            if not isinstance(value, list) or not all(isinstance(c, str) for c in value):
                raise ValueError("choices must be a list of strings")
            if not 2 <= len(value) <= MAX_CHOICES:
                raise ValueError(f"choices lists {len(value)} options; give 2 to {MAX_CHOICES}")
            out[name] = tuple(_bounded(c, "a choice") for c in value)
        elif value is None and name in ("video", "audio", "answer", "rubric"):
            out[name] = None
        elif not isinstance(value, str):
            raise ValueError(f"{name} must be a string; got {type(value).__name__}")
        else:
            out[name] = _bounded(value, name)
    if not str(out.get("question", "")).strip():
        raise ValueError("the question is missing or empty")
    return out


def _bounded(text: str, what: str) -> str:
    if len(text) > MAX_TEXT_CHARS:
        raise ValueError(f"{what} has {len(text)} characters; at most {MAX_TEXT_CHARS}")
    return text


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 120 else f"{text[:120]!r}... ({len(text)} characters)"


def is_file_key(prompt: str) -> bool:
    """Whether a data-stream prompt is a question file's key."""
    return prompt.startswith("{")


_KEPT = frozenset(string.ascii_lowercase + string.digits)


def normalise_answer(text: str) -> str:
    """Lower case, single spaces, no punctuation: what exact match compares (a-z and 0-9 kept, every
    other character a space). Linear in the text's length."""
    return " ".join("".join(c if c in _KEPT else " " for c in text.lower()).split())


def chosen_letter(answer: str, choices: tuple[str, ...]) -> str | None:
    """The option an answer picks, as its letter (A, B, ...), or None when it picks none or several.

    Accepted: the letter alone ("B", "(b)", "B."), the letter after "answer", "answer is", "option"
    or "option is" ("the answer is B"), or the text of exactly one option ("blue"). One pass over the
    words; no regular expressions."""
    letters = {c.lower() for c in LETTERS[: len(choices)]}
    words = normalise_answer(answer).split(" ")
    if len(words) == 1 and words[0] in letters:
        return words[0].upper()
    for i, word in enumerate(words[:-1]):
        after = words[i + 2] if words[i + 1] == "is" and i + 2 < len(words) else words[i + 1]
        if word in ("answer", "option") and after in letters:
            return after.upper()
    said = normalise_answer(answer)
    named = [LETTERS[i] for i, c in enumerate(choices) if normalise_answer(c) and _has_phrase(said, c)]
    return named[0] if len(named) == 1 else None


def _has_phrase(said: str, choice: str) -> bool:
    return f" {normalise_answer(choice)} " in f" {said} "


def reference_letter(question: FileQuestion) -> str | None:
    """The letter of a multiple-choice question's right answer (its answer may be the letter or the
    option's text); None when the question has no choices or no answer."""
    if not question.choices or question.answer is None:
        return None
    answer = normalise_answer(question.answer)
    for i, choice in enumerate(question.choices):
        if answer in (LETTERS[i].lower(), normalise_answer(choice)):
            return LETTERS[i]
    raise ValueError(
        f"the answer {question.answer!r} is neither a letter nor the text of one of the choices "
        f"{list(question.choices)}"
    )


def is_right(answer: str, question: AskedQuestion) -> float:
    """1.0 when the normalised answer is the question's right answer (or, for a multiple-choice
    question whose answer is a letter, picks that option), else 0.0."""
    if question.reference is None:
        raise ValueError(f"the question {question.text!r} has no right answer to grade against")
    if normalise_answer(answer) == normalise_answer(question.reference):
        return 1.0
    letter = normalise_answer(question.reference).upper()
    if len(letter) != 1 or letter not in LETTERS[: len(question.choices)]:
        return 0.0
    return float(chosen_letter(answer, question.choices) == letter)
