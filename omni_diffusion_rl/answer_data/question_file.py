"""A user's questions about their own clips: a JSONL file, one question per line.

    {"video": "clips/dog.mp4", "audio": "clips/dog.wav", "question": "what barks ?", "answer": "dog"}
    {"video": "clips/tv.mp4", "question": "which colour ?", "choices": ["red", "blue"], "answer": "B",
     "split": "heldout", "category": "colour"}

Fields: `question` (required); `video` and/or `audio`, paths relative to the file's folder (at least
one); `answer` (the right answer: exact-match and letter rewards grade against it) and/or `rubric`
(what a served judge reward is told to look for); `choices` (2-26 options: a multiple-choice question,
whose answer is a letter or an option's text); `split`: `train` (default) or `heldout`; `category`:
what held-out accuracy is broken down by (default `all`). Blank lines and lines starting with `#`
are skipped.

`data.prompts` reads the file's `train` lines and `data.eval_prompts` its `heldout` lines (the same
file may be named twice). Every line's media is decoded once at load, at the run's clip format; a
line that cannot be used is counted and skipped with its reason (`QuestionFileReport`), and a split
left with no usable line is an error that lists the reasons.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from .clip_files import ClipFileError, ClipFormat
from .questions import MAX_KEY_CHARS, FileQuestion, checked_fields, parse_json_object, reference_letter

logger = logging.getLogger(__name__)

SPLITS = ("train", "heldout")
LINE_FIELDS = (*FileQuestion.__dataclass_fields__, "split", "id")
MAX_FILE_BYTES = 64 << 20
MAX_LINE_CHARS = 64 << 10
MAX_LINES = 1_000_000
SHOWN_REASONS = 5
MAX_CATEGORIES = 64
PROGRESS_FROM = 500  # lines: a progress bar while a larger file's clips are decoded


class QuestionFileError(ValueError):
    """A question file that cannot be used at all."""


@dataclass
class QuestionFileReport:
    """The usable questions of one split (their keys), and every line skipped, with its reason."""

    path: Path
    split: str
    keys: list[str] = field(default_factory=list)
    skipped: list[tuple[int, str]] = field(default_factory=list)  # (line number, reason)
    other_split: int = 0
    categories: set[str] = field(default_factory=set)

    def summary(self) -> str:
        head = f"{self.path} ({self.split}): {len(self.keys)} questions, {len(self.skipped)} lines skipped"
        reasons = [f"line {n}: {why}" for n, why in self.skipped[:SHOWN_REASONS]]
        more = len(self.skipped) - SHOWN_REASONS
        return "; ".join([head, *reasons, *([f"and {more} more"] if more > 0 else [])])


def is_question_file(source: str) -> bool:
    """Whether a prompt source names a question file (by its .jsonl suffix)."""
    return source.lower().endswith(".jsonl")


def load_question_file(path: str | Path, split: str, clip: ClipFormat) -> QuestionFileReport:
    """The keys of `split`'s usable questions in `path`, each line's media decoded at `clip`."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    path = Path(path)
    if not path.is_file():
        raise QuestionFileError(f"question file {path} does not exist (or is not a regular file)")
    if path.stat().st_size > MAX_FILE_BYTES:
        raise QuestionFileError(f"question file {path} is over {MAX_FILE_BYTES >> 20} MiB; split it")
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is allowed
    report = QuestionFileReport(path, split)
    lines = [line.removesuffix(b"\r") for line in data.split(b"\n")]  # JSON strings may hold U+2028
    shown = tqdm(lines, desc=f"decoding {path.name}", unit="line", disable=len(lines) < PROGRESS_FROM)
    for number, line in enumerate(shown, start=1):
        if number > MAX_LINES:
            raise QuestionFileError(f"question file {path} has over {MAX_LINES} lines; split it")
        if not line.strip() or line.lstrip().startswith(b"#"):
            continue
        try:
            question, line_split = _parse_line(_utf8(line), path.parent)
            if line_split != split:
                report.other_split += 1
                continue
            question.check_media(clip)  # a bad file is found now (its refusal remembered for the run)
        except (ValueError, ClipFileError) as e:
            report.skipped.append((number, str(e)))
            continue
        report.keys.append(question.key())
        report.categories.add(question.category)
        if len(report.categories) > MAX_CATEGORIES:
            raise QuestionFileError(
                f"question file {path} names over {MAX_CATEGORIES} categories (line {number}); a category "
                "groups held-out accuracy, so use a few"
            )
    if report.skipped:
        logger.warning(report.summary())
    if not report.keys:
        reasons = Counter(why for _, why in report.skipped)
        listed = "; ".join(f"{why} ({n}x)" for why, n in reasons.most_common(SHOWN_REASONS))
        raise QuestionFileError(
            f"question file {path} has no usable {split} question"
            + (f": {len(report.skipped)} lines skipped: {listed}" if report.skipped else "")
            + ("" if report.skipped or split == "train" else ' (mark held-out lines with "split": "heldout")')
        )
    return report


def _utf8(line: bytes) -> str:
    """A line's text; a line that is not UTF-8 is refused alone (ValueError), not the whole file."""
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the line is not UTF-8 text (byte {e.start + 1}: {e.reason})") from None


def _parse_line(line: str, folder: Path) -> tuple[FileQuestion, str]:
    if len(line) > MAX_LINE_CHARS:
        raise ValueError(f"the line has {len(line)} characters; at most {MAX_LINE_CHARS}")
    raw = parse_json_object(line)
    if isinstance(raw, dict):
        split = raw.pop("split", "train")
        raw.pop("id", None)
        if split not in SPLITS:
            raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    else:
        split = "train"
    fields = checked_fields(raw, LINE_FIELDS)
    if fields.get("video") is None and fields.get("audio") is None:
        raise ValueError("the line names neither a video nor an audio file")
    if fields.get("answer") is None and fields.get("rubric") is None:
        raise ValueError("the line has neither an answer nor a rubric to grade by")
    for name in ("video", "audio"):
        if fields.get(name) is not None:
            fields[name] = str(_inside(folder, str(fields[name])))
    question = FileQuestion(**fields)  # type: ignore[arg-type]
    if question.choices and question.answer is not None:
        reference_letter(question)  # an answer that is no option is refused here
    if len(question.key()) > MAX_KEY_CHARS:
        raise ValueError(f"the line's fields take {len(question.key())} characters; at most {MAX_KEY_CHARS}")
    return question, split


def _inside(folder: Path, relative: str) -> Path:
    """A media path under the question file's folder: absolute paths, drives, `..` and links that
    lead outside the folder are refused."""
    posix = PurePosixPath(relative.replace("\\", "/"))
    outside = (
        not posix.parts
        or posix.is_absolute()
        or ".." in posix.parts
        or relative.startswith("~")
        or ":" in posix.parts[0]  # a Windows drive (C:) or a URL scheme
    )
    if not outside:  # the resolved path is what is read: a link retargeted later is never followed
        path = (folder / Path(*posix.parts)).resolve()
        outside = not path.is_relative_to(folder.resolve())
    if outside:
        raise ValueError(
            f"media path {relative!r} must be relative to the question file's folder and stay inside it "
            "(no absolute path, no '..', no link leading out)"
        )
    return path
