"""The documentation site builds, strict, and says what the code and the history say.

`mkdocs build --strict` (mkdocs.yml) into a temporary folder: a broken link or anchor between pages,
a page missing from the nav or a nav entry without its page is a warning, and strict mode fails on
any warning. The README is not part of the site, so its links to the pages are checked here, anchors
included. docs/architecture.md draws the layers of tests/test_import_graph.py (LAYERS is the truth):
every layer prefix must be on it. Every row of a results table with a commit column names a commit
of this repository and a date.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .helpers import REPO
from .test_import_graph import LAYERS, PACKAGE

DOCS = REPO / "docs"
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.M)
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def mkdocs_env() -> dict[str, str]:
    # NO_MKDOCS_2_WARNING: mkdocs-material >= 9.7 prints a banner about MkDocs 2 on every build
    return {**os.environ, "NO_MKDOCS_2_WARNING": "1"}


def nav_pages(config: Path = REPO / "mkdocs.yml") -> list[str]:
    """The pages of mkdocs.yml's nav, in order (paths relative to docs/)."""

    def walk(node: object) -> list[str]:
        if isinstance(node, str):
            return [node]
        if isinstance(node, list):
            return [page for item in node for page in walk(item)]
        if isinstance(node, dict):
            return [page for value in node.values() for page in walk(value)]
        return []

    return walk(yaml.safe_load(config.read_text(encoding="utf-8"))["nav"])


def anchors(markdown: str) -> set[str]:
    """The ids Python-Markdown's toc gives the headings of a page (fenced blocks left out)."""
    from markdown.extensions.toc import slugify

    text = FENCE.sub("", markdown)
    return {slugify(re.sub(r"[`*_]", "", title), "-") for title in HEADING.findall(text)}


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path: Path) -> None:
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.fail('mkdocs and mkdocs-material are missing: pip install -e ".[test]" (or make docs)')
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=REPO,
        env=mkdocs_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-5000:]
    assert "WARNING" not in output, output[-5000:]
    for page in nav_pages():
        html = "index.html" if Path(page).stem in ("index", "README") else f"{Path(page).stem}/index.html"
        assert (tmp_path / "site" / Path(page).parent / html).is_file(), f"{page} was not built"


def test_every_page_is_in_the_nav() -> None:
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    nav = nav_pages()
    assert sorted(nav) == pages, f"in docs/ but not in the nav: {sorted(set(pages) - set(nav))}; " + (
        f"in the nav but not in docs/: {sorted(set(nav) - set(pages))}"
    )


def test_the_readme_links_resolve() -> None:
    """Relative links of README.md reach a file of the checkout, and a page's anchor exists."""
    broken = []
    for target in LINK.findall((REPO / "README.md").read_text(encoding="utf-8")):
        if re.match(r"[a-z]+://|mailto:", target):
            continue
        path, _, anchor = target.partition("#")
        file = REPO / path if path else REPO / "README.md"
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text(encoding="utf-8")):
            broken.append(f"{target}: no heading with that anchor in {path or 'README.md'}")
    assert not broken, "\n".join(broken)


def test_the_anchor_rule_matches_the_site_builder() -> None:
    page = "# Title\n## auto's re-check\n```text\n## not a heading\n```\n## Real models (diffusers)\n"
    assert anchors(page) == {"title", "autos-re-check", "real-models-diffusers"}


def test_the_architecture_page_names_every_layer() -> None:
    text = (DOCS / "architecture.md").read_text(encoding="utf-8")
    layers = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    missing = [
        prefix
        for layer in LAYERS
        for prefix in layer
        if not re.search(
            rf"(?<![\w.]){re.escape(prefix.removeprefix(PACKAGE + '.').rstrip('*'))}(?!\w)", layers
        )
    ]
    assert not missing, f"docs/architecture.md's layers miss {missing} (tests/test_import_graph.py LAYERS)"


def _result_rows(markdown: str) -> list[tuple[str, str]]:
    """(header, row) of every table row whose header has a commit column."""
    rows, header = [], None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
        elif header is None:
            header = line
        elif not re.fullmatch(r"\|[\s\-:|]+\|", line) and "commit" in header:
            rows.append((header, line))
    return rows


def test_every_result_row_names_its_commit_and_date() -> None:
    pages = [REPO / "README.md", DOCS / "results.md", DOCS / "algorithms.md"]
    rows = [(page.name, row) for page in pages for _, row in _result_rows(page.read_text(encoding="utf-8"))]
    assert len(rows) >= 30, "the results tables were not found"
    undated = [
        f"{name}: {row}"
        for name, row in rows
        if not (re.search(r"`[0-9a-f]{7,40}`", row) and re.search(r"\b20\d\d-\d\d-\d\d\b", row))
    ]
    assert not undated, "result rows without a commit and a date:\n" + "\n".join(undated)


@pytest.mark.slow
def test_the_commits_the_results_name_exist() -> None:
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True, text=True
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("no full git history here to look the commits up in")
    text = "".join(
        p.read_text(encoding="utf-8") for p in [REPO / "README.md", *DOCS.glob("*.md")] if p.is_file()
    )
    unknown = [
        sha
        for sha in sorted(set(re.findall(r"`([0-9a-f]{7})`", text)))
        if subprocess.run(["git", "cat-file", "-e", f"{sha}^{{commit}}"], cwd=REPO).returncode != 0
    ]
    assert not unknown, f"results name commits this repository does not have: {unknown}"
