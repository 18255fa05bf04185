"""The later half of the documentation's commands (LATER_PAGES), run as tests/test_readme_commands.py
runs the README's and the first pages', in a scratch copy of their own: two files, so that the two
halves run on two test workers at once."""

from __future__ import annotations

from pathlib import Path

import pytest

from .test_readme_commands import LATER_PAGES, documents, run_and_check

pytestmark = pytest.mark.slow


def test_the_later_pages_commands_run_as_written(tmp_path: Path) -> None:
    ran = run_and_check(tmp_path, lambda doc: doc.name in LATER_PAGES)
    assert {r["file"] for r in ran} == {f"docs/{page}" for page in LATER_PAGES}, "a later page ran nothing"


def test_the_later_pages_are_pages_of_the_nav() -> None:
    names = [doc.name for doc in documents(Path(__file__).resolve().parent.parent)]
    assert set(LATER_PAGES) <= set(names), sorted(set(LATER_PAGES) - set(names))
