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

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from tqdm import tqdm

from .clip_files import ClipFileError, ClipFormat, decode_sound_track
from .questions import MAX_KEY_CHARS, FileQuestion, checked_fields, parse_json_object, reference_letter

logger = logging.getLogger(__name__)

SPLITS = ("train", "heldout")
LINE_FIELDS = (*FileQuestion.__dataclass_fields__, "split", "id")
MAX_FILE_BYTES = 64 << 20
MAX_LINE_CHARS = 64 << 10
MAX_LINES = 1_000_000
SHOWN_KINDS = 30  # kinds of reason in a report (each with its count); the rest are summed
SHOWN_LINES = 8  # line numbers listed per kind
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
        """The questions kept, and every skipped line counted by kind of reason, most common first:
        each kind with its count, its first line's reason and the lines it covers."""
        head = f"{self.path} ({self.split}): {len(self.keys)} questions, {len(self.skipped)} lines skipped"
        kinds = skip_kinds(self.skipped)
        parts = [head]
        for lines, example in kinds[:SHOWN_KINDS]:
            listed = ", ".join(map(str, lines[:SHOWN_LINES])) + (", ..." if len(lines) > SHOWN_LINES else "")
            parts.append(f"{len(lines)}x {example} (line{'s' if len(lines) > 1 else ''} {listed})")
        rest = kinds[SHOWN_KINDS:]
        if rest:
            hidden = sum(len(lines) for lines, _ in rest)
            parts.append(f"{hidden} lines for {len(rest)} other kinds of reason")
        return "; ".join(parts)


MAX_REASON_CHARS = 500  # of a skipped line's reason (reasons may quote the line)
_DIGITS = re.compile(r"\d+")


def skip_kinds(skipped: list[tuple[int, str]]) -> list[tuple[list[int], str]]:
    """Skipped lines grouped by their reason with paths and numbers set aside (two clips too short by
    different amounts are one kind): each kind's line numbers and its first reason, most lines first.
    Linear in the reasons' lengths."""
    kinds: dict[str, tuple[list[int], str]] = {}
    for number, why in skipped:
        words = why[:MAX_REASON_CHARS].split()
        kind = " ".join("#" if "/" in w or "\\" in w else _DIGITS.sub("#", w) for w in words)
        kinds.setdefault(kind, ([], why))[0].append(number)
    return sorted(kinds.values(), key=lambda kind: -len(kind[0]))


def is_question_file(source: str) -> bool:
    """Whether a prompt source names a question file (by its .jsonl suffix)."""
    return source.lower().endswith(".jsonl")


def load_question_file(
    path: str | Path, split: str, clip: ClipFormat, sound_from_video: bool = True
) -> QuestionFileReport:
    """The keys of `split`'s usable questions in `path`, each line's media decoded at `clip`. With
    `sound_from_video` (data.audio_from_video=auto), a line naming a video and no audio takes the
    video file's own sound track as its audio (its key names the video file twice); a video without
    one is skipped, with its reason."""
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
        unreadable: ValueError | None = None
        try:
            raw, line_split = _split_of(_utf8(line))
        except ValueError as e:  # no split to read: the default split's fault, listed there only
            unreadable, line_split = e, "train"
        if line_split != split:  # a line is checked, and its faults listed, under its own split only
            report.other_split += 1
            continue
        try:
            if unreadable is not None:
                raise unreadable
            question = _parse_line(raw, path.parent)
            question.check_media(clip)  # a bad file is found now (its refusal remembered for the run)
            if sound_from_video and question.audio is None and question.video is not None:
                question = _with_sound_track(question, clip)
        except (ValueError, ClipFileError) as e:
            why = str(e)
            report.skipped.append(
                (number, why if len(why) <= MAX_REASON_CHARS else why[:MAX_REASON_CHARS] + "...")
            )
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
        kinds = skip_kinds(report.skipped)[:SHOWN_KINDS]
        listed = "; ".join(f"{why} ({len(lines)}x)" for lines, why in kinds)
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


def _with_sound_track(question: FileQuestion, clip: ClipFormat) -> FileQuestion:
    """The question with its video file as its audio too, when the file has a sound track; a
    ClipFileError naming the choices when it has none."""
    try:
        decode_sound_track(str(question.video), clip)
    except ClipFileError as e:
        raise ClipFileError(
            f'{e}; the line names no audio file and the model reads sound: give it an "audio" file, '
            "or set data.audio_from_video=never to read silence"
        ) from None
    heard = dataclasses.replace(question, audio=question.video)
    _check_key_length(heard, " with its sound")
    return heard


def _check_key_length(question: FileQuestion, note: str = "") -> None:
    """A line whose key (its fields as the run carries them) is over MAX_KEY_CHARS is refused."""
    size = len(question.key())
    if size > MAX_KEY_CHARS:
        raise ValueError(f"the line's fields take {size} characters{note}; at most {MAX_KEY_CHARS}")


def _split_of(line: str) -> tuple[object, str]:
    """A line's JSON value and the split it belongs to. A line that is not a JSON object, or names no
    valid split, is the train split's fault (the default split): raised only there."""
    if len(line) > MAX_LINE_CHARS:
        raise ValueError(f"the line has {len(line)} characters; at most {MAX_LINE_CHARS}")
    raw = parse_json_object(line)
    if not isinstance(raw, dict):
        return raw, "train"
    split = raw.pop("split", "train")
    raw.pop("id", None)
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: use one of {', '.join(SPLITS)}")
    return raw, split


def _parse_line(raw: object, folder: Path) -> FileQuestion:
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
    _check_key_length(question)
    return question


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
