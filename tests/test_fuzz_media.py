"""Fuzzing what a question file's user controls (hypothesis, bounded in examples, not time): the line
parser gets arbitrary text and JSON objects built from hostile values, the clip loaders get valid
MP4 and WAV files with bytes overwritten, cut or inserted (their headers first). Each must either
give what the format promises or refuse with the error it documents (ValueError for a line,
ClipFileError for a file): any other exception would end a run with a traceback. Decoded clips must
keep the clip format's promises: the format's frame count and size, values in [0, 1] (video) or
[-1, 1] (sound), finite."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, seed, settings
from hypothesis import strategies as st

from omni_diffusion_rl.answer_data.clip_files import (
    ClipFileError,
    ClipFormat,
    check_video,
    decode_audio,
    decode_video,
    write_mp4,
    write_wav,
)
from omni_diffusion_rl.answer_data.question_file import _parse_line
from omni_diffusion_rl.world.avqa_files import example_clips
from omni_diffusion_rl.world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE

AT_16 = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (16, 16))
FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def clip_bytes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """A valid tiny clip's MP4 and WAV bytes."""
    folder = tmp_path_factory.mktemp("clip")
    clip = example_clips(1, 0)[0]
    write_mp4(folder / "a.mp4", clip.video, FPS)
    write_wav(folder / "a.wav", clip.wave, SAMPLE_RATE)
    return {"mp4": (folder / "a.mp4").read_bytes(), "wav": (folder / "a.wav").read_bytes()}


VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.lists(st.text(max_size=12), max_size=5),
    st.dictionaries(st.text(max_size=8), st.integers(), max_size=3),
)
GOOD = {"video": "clips/a.mp4", "question": "which shape", "answer": "circle", "split": "heldout"}
FIELDS = ["question", "video", "audio", "answer", "choices", "rubric", "category", "split", "id", "other"]


@seed(42)
@FUZZ
@given(
    st.one_of(
        st.text(max_size=300),
        st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=8),
        st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=3).map(lambda hostile: {**GOOD, **hostile}),
    )
)
def test_a_fuzzed_line_parses_or_is_a_value_error(tmp_path: Path, line: object) -> None:
    text = line if isinstance(line, str) else json.dumps(line)
    try:
        question, split = _parse_line(text, tmp_path)
    except ValueError:
        event("refused")
        return
    event("parsed")
    assert split in ("train", "heldout") and question.question is not None
    assert question.video is not None or question.audio is not None
    for name in ("video", "audio"):  # media stay inside the folder
        value = getattr(question, name)
        assert value is None or Path(value).resolve().is_relative_to(tmp_path.resolve())


def _mutated(data: bytes, edits: list[tuple[int, int, bytes]], cut: int | None) -> bytes:
    """`data` with each (position, kind, bytes) edit: kind 0 overwrites, 1 inserts, 2 deletes; then
    cut to `cut` bytes when given. Positions fall mostly in the first 256 bytes (the headers)."""
    out = bytearray(data)
    for position, kind, chunk in edits:
        at = position % max(1, min(len(out), 256 if position % 4 else len(out)))
        if kind == 0:
            out[at : at + len(chunk)] = chunk
        elif kind == 1:
            out[at:at] = chunk
        else:
            del out[at : at + len(chunk)]
    return bytes(out[:cut] if cut is not None else out)


EDITS = st.lists(
    st.tuples(st.integers(0, 1 << 20), st.integers(0, 2), st.binary(min_size=1, max_size=8)),
    min_size=1,
    max_size=6,
)


@seed(7)
@FUZZ
@given(edits=EDITS, cut=st.one_of(st.none(), st.integers(0, 4096)))
def test_a_fuzzed_mp4_decodes_to_the_format_or_is_refused(
    tmp_path: Path, clip_bytes: dict[str, bytes], edits: list[tuple[int, int, bytes]], cut: int | None
) -> None:
    path = tmp_path / "fuzzed.mp4"
    path.write_bytes(_mutated(clip_bytes["mp4"], edits, cut))
    try:
        check_video(path, AT_16)
        video = decode_video(path, AT_16)
    except ClipFileError:
        event("refused")
        return
    event("decoded")
    assert video.shape == (AT_16.frames, 3, 16, 16) and video.dtype == torch.float32
    assert torch.isfinite(video).all() and video.min() >= 0 and video.max() <= 1


@seed(11)
@FUZZ
@given(edits=EDITS, cut=st.one_of(st.none(), st.integers(0, 4096)))
def test_a_fuzzed_wav_decodes_to_the_format_or_is_refused(
    tmp_path: Path, clip_bytes: dict[str, bytes], edits: list[tuple[int, int, bytes]], cut: int | None
) -> None:
    path = tmp_path / "fuzzed.wav"
    path.write_bytes(_mutated(clip_bytes["wav"], edits, cut))
    try:
        audio = decode_audio(path, AT_16)
    except ClipFileError:
        event("refused")
        return
    event("decoded")
    assert audio.shape == (1, AT_16.samples) and torch.isfinite(audio).all() and audio.abs().max() <= 1
