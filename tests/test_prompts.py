"""Prompt sources: the built-in tiny-world sets and UTF-8 prompt files."""

from __future__ import annotations

from pathlib import Path

import pytest

from omni_diffusion_rl.prompts import BUILTIN, PromptFileError, load_prompts
from omni_diffusion_rl.world import tiny_world


def test_builtin_sets_non_empty_and_disjoint() -> None:
    train = load_prompts("builtin:tiny_world")
    heldout = load_prompts("builtin:tiny_world_heldout")
    assert train and heldout
    assert not set(train) & set(heldout)
    assert len(set(train)) == len(train) and len(set(heldout)) == len(heldout)
    assert len(train) + len(heldout) == len(tiny_world.ALL_SCENES)
    assert all(tiny_world.parse_prompt(p) is not None for p in train + heldout)


def test_builtin_returns_a_copy() -> None:
    prompts = load_prompts("builtin:tiny_world")
    prompts.clear()
    assert load_prompts("builtin:tiny_world") == tiny_world.TRAIN_PROMPTS != []


def test_unknown_builtin_lists_the_choices() -> None:
    with pytest.raises(PromptFileError) as info:
        load_prompts("builtin:nope")
    assert "builtin:nope" in str(info.value)
    for name in BUILTIN:
        assert name in str(info.value)


def test_file_with_comments_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "prompts.txt"
    path.write_text(
        "# my prompts\n\n  a red circle with a high tone at the start  \n   # an indented comment\n"
        "\t\nun café au lait # not a comment\r\n\n",
        encoding="utf-8",
    )
    assert load_prompts(str(path)) == [
        "a red circle with a high tone at the start",
        "un café au lait # not a comment",
    ]


@pytest.mark.parametrize("content", ["", "   \n\t\n\n", "# only\n  # comments\n"])
def test_file_without_prompts_raises_naming_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.txt"
    path.write_text(content, encoding="utf-8")
    with pytest.raises(PromptFileError, match="no prompts") as info:
        load_prompts(str(path))
    assert str(path) in str(info.value)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.txt"
    path.write_bytes(b"\xff\xfe caf\xe9")
    with pytest.raises(PromptFileError, match="UTF-8") as info:
        load_prompts(str(path))
    assert str(path) in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.txt"
    with pytest.raises(PromptFileError, match="does not exist") as info:
        load_prompts(str(path))
    assert str(path) in str(info.value)
    with pytest.raises(PromptFileError, match="is a directory; give a UTF-8 text file"):
        load_prompts(str(tmp_path))  # a directory is not a prompt file
