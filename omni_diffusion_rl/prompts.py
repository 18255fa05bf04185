"""Prompt sources: the built-in tiny-world lists, a UTF-8 text file (one prompt per line), or a
question file (answer_data/question_file.py: a JSONL file of questions about clips, whose prompts are
its lines' keys)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from .answer_data.clip_files import ClipFormat
from .answer_data.question_file import QuestionFileError, is_question_file, load_question_file
from .config import ConfigError
from .world import avqa, tiny_sync, tiny_world

if TYPE_CHECKING:
    from .config import DataConfig

BUILTIN = {
    "builtin:tiny_world": tiny_world.TRAIN_PROMPTS,
    "builtin:tiny_world_heldout": tiny_world.HELDOUT_PROMPTS,
    "builtin:tiny_sync": tiny_sync.TRAIN_PROMPTS,
    "builtin:tiny_sync_heldout": tiny_sync.HELDOUT_PROMPTS,
    "builtin:tiny_avqa": avqa.TRAIN_QUESTIONS,  # "<kind> | <scene>": questions about tiny-world clips
    "builtin:tiny_avqa_heldout": avqa.HELDOUT_QUESTIONS,
}


class PromptFileError(ValueError):
    """A prompt source that cannot be used."""


MAX_PROMPT_FILE_BYTES = 64 << 20


def clip_format_of(data: DataConfig) -> ClipFormat:
    """The clip format a run decodes question files at (data.clip_*)."""
    return ClipFormat(data.clip_fps, data.clip_sample_rate, data.clip_seconds, data.clip_channels)


def split_prompts(data: DataConfig, split: str) -> list[str]:
    """A run's prompts of `split`: data.prompts' train lines or data.eval_prompts' heldout lines, a
    question file's clips decoded at data.clip_* (and data.audio_from_video)."""
    source = data.prompts if split == "train" else data.eval_prompts
    return load_prompts(source, split, clip_format_of(data), data.audio_from_video == "auto")


def load_prompts(
    source: str, split: str = "train", clip: ClipFormat | None = None, sound_from_video: bool = True
) -> list[str]:
    """Prompts from 'builtin:NAME' or a text file (blank lines and '#' comments are skipped), or the
    keys of a question file's `split` lines, their clips decoded at `clip` (bad lines skipped with
    a logged reason; a split with none usable is an error; `sound_from_video`: load_question_file)."""
    if is_question_file(source):
        if clip is None:
            raise PromptFileError(f"{source} is a question file: reading it needs the run's clip format")
        try:
            return load_question_file(source, split, clip, sound_from_video).keys
        except QuestionFileError as e:
            raise PromptFileError(str(e)) from e
    if source.startswith("builtin:"):
        if source not in BUILTIN:
            raise PromptFileError(
                f"unknown built-in prompt set '{source}'; choose one of {', '.join(BUILTIN)}"
            )
        return list(BUILTIN[source])
    path = Path(source)
    if path.is_dir():
        raise PromptFileError(
            f"prompt file {path} is a directory; give a UTF-8 text file with one prompt a line"
        )
    if path.exists() and not path.is_file():
        raise PromptFileError(
            f"prompt file {path} is not a regular file (a device, pipe or socket); give a UTF-8 text file "
            "with one prompt a line"
        )
    if not path.is_file():
        raise PromptFileError(f"prompt file {path} does not exist (or use one of {', '.join(BUILTIN)})")
    if path.stat().st_size > MAX_PROMPT_FILE_BYTES:
        raise PromptFileError(f"prompt file {path} is over {MAX_PROMPT_FILE_BYTES >> 20} MiB; split it")
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise PromptFileError(
            f"prompt file {path} is not UTF-8 text (byte {e.start}: {e.reason}); re-save it as UTF-8"
        ) from e
    except OSError as e:
        raise PromptFileError(f"prompt file {path} cannot be read ({e.strerror or e})") from e
    prompts = [
        line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
    ]
    keyed = next((i for i, p in enumerate(prompts, 1) if p.startswith("{")), None)
    if keyed is not None:
        raise PromptFileError(
            f"prompt file {path}: prompt {keyed} starts with '{{', which names a question file's line; put "
            "questions about clips in a question file (.jsonl), or start the prompt with another character"
        )
    if not prompts:
        raise PromptFileError(f"prompt file {path} has no prompts: write one prompt per line")
    return prompts


def _question_files(data: DataConfig) -> list[str]:
    return [source for source in (data.prompts, data.eval_prompts) if is_question_file(source)]


def refuse_question_files(data: DataConfig) -> None:
    """A generator's run names no question file: its prompts would be the questions' keys."""
    named = _question_files(data)
    if named:
        raise ConfigError(
            f"data.prompts / data.eval_prompts name the question file {named[0]}: question files are for "
            "answering models (algorithm.name=gspo); a generator takes a text file of prompts"
        )


def ready_to_answer(data: DataConfig, family: str, policy: Any) -> None:
    """What every process does to an answering model before it reads a question: its clip format
    checked against data.clip_* (check_clip_format), and data.system_prompt set as its system turn
    (a model without a chat template to hold one is refused)."""
    check_clip_format(data, family, policy)
    if data.system_prompt is None:
        return
    use = getattr(policy.model, "use_system_prompt", None)
    if use is None:
        raise ConfigError(
            f"data.system_prompt: model.family={family} has no chat template to hold a system turn (the "
            "tiny omni model reads the question alone); drop it, or use a chat model (qwen2_5_omni)"
        )
    try:
        use(data.system_prompt)
    except ValueError as e:
        raise ConfigError(str(e)) from e


def check_clip_format(data: DataConfig, family: str, policy: Any) -> None:
    """A run that reads question files decodes their clips at data.clip_*: refused unless that is the
    format the model reads (its `clip_format`)."""
    problem = clip_format_problem(data, family, policy.model.clip_format)
    if problem is not None:
        raise ConfigError(problem)


def clip_format_problem(data: DataConfig, family: str, theirs: ClipFormat) -> str | None:
    """Why question files decoded at data.clip_* do not suit a model reading `theirs` (None: they
    do, or no question file is read). `odrl train --check` asks it too, before loading the model."""
    if not _question_files(data):
        return None
    ours = clip_format_of(data)
    if ours.timing() == theirs.timing():
        return None
    return (
        f"data.clip_fps={ours.fps:g}, clip_sample_rate={ours.sample_rate}, "
        f"clip_seconds={ours.seconds:g}, clip_channels={ours.channels}: model.family="
        f"{family} reads clips at {theirs.fps:g} fps, {theirs.sample_rate} Hz, "
        f"{theirs.seconds:g} s, {theirs.channels} channel(s); set data.clip_* to those"
    )
