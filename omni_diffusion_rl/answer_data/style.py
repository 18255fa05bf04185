"""How a question-file line becomes the text an answering model reads: its question, and for a
multiple-choice line its options, in a configurable format (data.choice_format, data.option_format,
data.option_separator). No torch here: the config checks a format as it loads."""

from __future__ import annotations

import string
from dataclasses import dataclass
from string import Formatter

MAX_FORMAT_CHARS = 500


@dataclass(frozen=True)
class QuestionStyle:
    """How a question-file line becomes the text the model reads (data.choice_format, option_format,
    option_separator): a multiple-choice line's options are rendered into it, each with its letter
    (A, B, ...) and text; a line without choices is its question alone. The default is tiny AVQA's
    own wording ("which colour ? options : red green blue"), which the tiny omni model was trained on;
    a chat model reads lettered options better (`{letter}. {text}`, one a line: the Qwen recipes)."""

    choice_format: str = "{question} options : {options}"
    option_format: str = "{text}"
    option_separator: str = " "

    def __post_init__(self) -> None:
        both = {"question", "options"}
        _check_format(self.choice_format, "data.choice_format", both, both)
        _check_format(self.option_format, "data.option_format", {"letter", "text"}, {"text"})
        if len(self.option_separator) > MAX_FORMAT_CHARS:
            raise ValueError(f"data.option_separator: at most {MAX_FORMAT_CHARS} characters")

    @classmethod
    def of(cls, data: object) -> QuestionStyle:
        """The style a run's data section (config.DataConfig) names."""
        return cls(data.choice_format, data.option_format, data.option_separator)  # type: ignore[attr-defined]

    def text(self, question: str, choices: tuple[str, ...]) -> str:
        """What the model reads for `question` with its `choices` (none: the question alone)."""
        if not choices:
            return question
        options = self.option_separator.join(
            self.option_format.format(letter=string.ascii_uppercase[i], text=c) for i, c in enumerate(choices)
        )
        return self.choice_format.format(question=question, options=options)


def _check_format(template: str, key: str, allowed: set[str], required: set[str]) -> None:
    """A str.format template naming only `allowed` fields, each of `required` once (a clear error
    otherwise: a typo in a field name would fail at the first multiple-choice line)."""
    try:
        fields = [(f, spec, conv) for _, f, spec, conv in Formatter().parse(template) if f is not None]
    except ValueError as e:
        raise ValueError(f"{key}={template!r} is not a format string ({e}); write braces as {{{{ }}}}") from e
    named = [f for f, _, _ in fields]
    if any(spec or conv for _, spec, conv in fields):
        raise ValueError(f"{key}={template!r}: fields take no conversion or format spec (write {{text}})")
    wrong = sorted({f for f in named if f not in allowed})
    if wrong:
        raise ValueError(f"{key}={template!r} names {wrong}; it may name {sorted(allowed)} (in braces)")
    for name in sorted(required):
        if named.count(name) != 1:
            raise ValueError(f"{key}={template!r} must name {{{name}}} exactly once")
    if len(template) > MAX_FORMAT_CHARS:
        raise ValueError(f"{key} has {len(template)} characters; at most {MAX_FORMAT_CHARS}")


PLAIN = QuestionStyle()
"""The default style."""
