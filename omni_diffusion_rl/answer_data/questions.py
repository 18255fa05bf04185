"""What an answering model is asked: a question about a clip, with its right answer when there is one.

A question from a file (question_file.py) travels through the run as its key: the line's fields in
canonical JSON, paths resolved. The key is the data stream's prompt, so it crosses the replay buffer
and the process boundaries as text, and every reward reads the right answer from it without a table.
Keys are parsed with a size and a nesting bound, and only the fields below are accepted.
"""

from __future__ import annotations

import functools
import json
import string
import unicodedata
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..bounded_json import nesting_depth
from ..registry import question_sets
from .clip_files import ClipFormat, check_video, decode_audio, decode_video
from .style import PLAIN, QuestionStyle

MAX_KEY_CHARS = 16384
MAX_TEXT_CHARS = 2000
MAX_CHOICES = 26
MAX_NESTING = 4
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
    letters: bool = False  # an option's letter alone answers it (a question-file line whose answer is
    # a letter: its options are shown lettered; a bare "a" is no answer to options listed without them)


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
        return cls(**checked_fields(parse_json_object(key), cls.__dataclass_fields__))

    def check_media(self, clip: ClipFormat) -> None:
        """Decode its media to check them (a ClipFileError says why they cannot be used); video
        frames are only decoded, never converted or kept, so a file's size never decides what
        checking it holds."""
        if self.video is not None:
            check_video(self.video, clip)
        if self.audio is not None:
            decode_audio(self.audio, clip)

    def asked(self, clip: ClipFormat, style: QuestionStyle = PLAIN) -> AskedQuestion:
        """The question (its options rendered in `style`) with its clip decoded at `clip`'s format."""
        return AskedQuestion(
            text=style.text(self.question, self.choices),
            reference=self.answer,
            category=self.category,
            video=None if self.video is None else decode_video(self.video, clip),
            audio=None if self.audio is None else decode_audio(self.audio, clip),
            choices=self.choices,
            letters=answers_by_letter(self),
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
            texts = [normalise_answer(c) for c in value]
            if not all(texts) or len(set(texts)) < len(texts):
                raise ValueError(
                    f"choices {value[:MAX_CHOICES]}: each must differ from the others in letters or digits"
                )
            if any(len(t) == 1 and t.upper() in LETTERS for t in texts):
                raise ValueError(
                    f"choices {value}: an option may not be a single letter (it reads as an option's letter)"
                )
        elif value is None and name in ("video", "audio", "answer", "rubric"):
            out[name] = None
        elif not isinstance(value, str):
            raise ValueError(f"{name} must be a string; got {type(value).__name__}")
        else:
            out[name] = _bounded(value, name)
    if not str(out.get("question", "")).strip():
        raise ValueError("the question is missing or empty")
    if out.get("answer") is not None and not normalise_answer(str(out["answer"])):
        raise ValueError(f"the answer {out['answer']!r} has no letter or digit to grade by")
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


def parse_json_object(text: str) -> object:
    """JSON of bounded nesting (MAX_NESTING): a deeper text is refused before it is parsed."""
    deepest = nesting_depth(text)
    if deepest > MAX_NESTING:
        raise ValueError(f"JSON nested {deepest} deep; a question is a flat object")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{_shown(text)} is not valid JSON ({e.msg} at column {e.colno})") from e


def normalise_answer(text: str) -> str:
    """What exact match compares: Unicode-normalised (NFKC) and case-folded, letters and digits of
    any script kept, every other character a space, single spaces. Linear in the text's length."""
    folded = unicodedata.normalize("NFKC", text).casefold()
    return " ".join("".join(c if c.isalnum() else " " for c in folded).split())


CUES = ("answer", "option")


def chosen_letter(answer: str, choices: tuple[str, ...]) -> str | None:
    """The option an answer picks, as its letter (A, B, ...), or None when it picks none, several,
    or reads two ways.

    Read, in this order: the answer is exactly one option's text ("dark red"); the answer is a letter
    alone ("B", "(b)", "B."); the answer ends with a letter after "answer", "answer is", "option" or
    "option is" ("the answer is B"); the answer names one option's text ("it is blue"; of nested
    options the longest, "dark red" over "red"). A letter and a named option that disagree give
    None. Linear in the answer's length; no regular expressions."""
    said = normalise_answer(answer)
    texts = [normalise_answer(c) for c in choices]
    if said in texts:
        return LETTERS[texts.index(said)]
    letters = [c.lower() for c in LETTERS[: len(choices)]]
    words = said.split(" ")
    if len(words) == 1 and words[0] in letters:
        return words[0].upper()
    cued = None
    if len(words) >= 2 and words[-1] in letters:
        before = words[-3] if words[-2] == "is" and len(words) >= 3 else words[-2]
        cued = words[-1].upper() if before in CUES else None
    named = [i for i, t in enumerate(texts) if t and f" {t} " in f" {said} "]
    widest = max(named, key=lambda i: len(texts[i]), default=None)
    if widest is not None and any(f" {texts[i]} " not in f" {texts[widest]} " for i in named):
        widest = None  # two options named that are not parts of one another
    by_text = None if widest is None else LETTERS[widest]
    if cued is not None and by_text is not None and cued != by_text:
        return None
    return cued or by_text


def reference_letter(question: FileQuestion) -> str | None:
    """The letter of a multiple-choice question's right answer (its answer may be the letter or the
    option's text); None when the question has no choices or no answer."""
    if not question.choices or question.answer is None:
        return None
    letter = _letter_of(question.answer, question.choices)
    if letter is not None:
        return letter
    raise ValueError(
        f"the answer {question.answer!r} is neither a letter nor the text of one of the choices "
        f"{list(question.choices)}"
    )


def answers_by_letter(question: FileQuestion) -> bool:
    """Whether a line's right answer is given as an option's letter (then a letter alone answers it,
    as well as the option's text)."""
    answer = normalise_answer(question.answer or "")
    return len(answer) == 1 and answer.upper() in LETTERS[: len(question.choices)]


def is_right(answer: str, question: AskedQuestion) -> float:
    """1.0 when the normalised answer is the question's right answer, or, for a multiple-choice
    question, exactly the right option's text, or its letter alone ("B", "(b)", "b.") where the
    question is answered by letter (`question.letters`: the file gives the answer as a letter); else
    0.0. A bare letter is no answer to options shown without letters (a policy saying "a" would be
    paid for every question whose first option is right). Reading an option out of a longer answer
    ("the answer is B", "it is blue") is choice_letter's."""
    if question.reference is None:
        raise ValueError(f"the question {question.text!r} has no right answer to grade against")
    said = normalise_answer(answer)
    if said == normalise_answer(question.reference):
        return 1.0
    right = _letter_of(question.reference, question.choices)
    if right is None:
        return 0.0
    text = normalise_answer(question.choices[LETTERS.index(right)])
    return float(said == text or (question.letters and said == right.lower()))


def _letter_of(reference: str, choices: tuple[str, ...]) -> str | None:
    """The letter of the option `reference` names (a letter or an option's text); None if none."""
    wanted = normalise_answer(reference)
    for i, choice in enumerate(choices):
        if wanted in (LETTERS[i].lower(), normalise_answer(choice)):
            return LETTERS[i]
    return None


DEFAULT_QUESTIONS = "tiny_avqa"
"""The registered question set that prompts not from a question file name (data.questions)."""


@functools.lru_cache(maxsize=16)
def question_set(name: str) -> Any:
    """The registered question set `name` (data.questions), made once."""
    return question_sets.get(name)()


def question_text(prompt: str, questions: str = DEFAULT_QUESTIONS, style: QuestionStyle = PLAIN) -> str:
    """The question a prompt names, as the model reads it (nothing decoded or rendered)."""
    if is_file_key(prompt):
        question = FileQuestion.from_key(prompt)
        return style.text(question.question, question.choices)
    return question_set(questions).text(prompt)
