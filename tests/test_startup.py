"""A process's start-up imports with the garbage collector paused and then frozen (runtime/startup.py),
which entry points make them (cli.entry, the forking launcher, the memory workers), and the
benchmark that measures what they save (`odrl bench startup`)."""

from __future__ import annotations

import gc
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.common import compare_paired
from omni_diffusion_rl.cli import STARTUP_IMPORTS, build_parser
from omni_diffusion_rl.runtime.startup import import_frozen

from .helpers import REPO

PROBE = "import gc\nCOLLECTOR_ON_AT_IMPORT = gc.isenabled()\n"


@pytest.fixture
def probe_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module that records whether the collector ran while it was imported; unfrozen afterwards
    (this test process is long-lived: it must not keep what it froze)."""
    name = f"startup_probe_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(PROBE, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        yield name
    finally:
        gc.unfreeze()
        gc.enable()
        sys.modules.pop(name, None)


@pytest.mark.parametrize("enabled_before", [True, False])
def test_imports_run_with_the_collector_paused_then_everything_is_frozen(
    probe_module: str, enabled_before: bool
) -> None:
    (gc.enable if enabled_before else gc.disable)()
    assert gc.get_freeze_count() == 0, "nothing else in the suite freezes"
    import_frozen([probe_module])
    assert sys.modules[probe_module].COLLECTOR_ON_AT_IMPORT is False, "the collector ran during the import"
    assert gc.get_freeze_count() > 1000, "what was alive is frozen"
    assert gc.isenabled() is enabled_before, "the collector is as it was"


def test_a_failed_import_still_gives_the_collector_back(probe_module: str) -> None:
    gc.enable()
    with pytest.raises(ModuleNotFoundError):
        import_frozen([probe_module, "no_such_module_anywhere"])
    assert gc.isenabled()


def test_every_command_with_start_up_imports_is_a_command() -> None:
    commands = next(a for a in build_parser()._actions if a.dest == "command").choices
    assert set(STARTUP_IMPORTS) <= set(commands), sorted(set(STARTUP_IMPORTS) - set(commands))
    assert {"train", "eval", "sample", "serve-teacher"} <= set(STARTUP_IMPORTS)


def test_the_console_script_is_the_entry_point() -> None:
    script = re.search(r'^odrl = "(.+)"$', (REPO / "pyproject.toml").read_text(encoding="utf-8"), re.M)
    assert script and script.group(1) == "omni_diffusion_rl.cli:entry"


AFTER_ENTRY = """
import gc, sys
from omni_diffusion_rl.cli import entry
try:
    entry([{command!r}, "--help"])
except SystemExit:
    pass
print(gc.get_freeze_count() > 0, "peft" in sys.modules, gc.isenabled())
"""


@pytest.mark.slow  # a fresh process: freezing this one would keep the suite's garbage
@pytest.mark.parametrize(
    ("command", "expected"), [("train", "True True True"), ("simulate", "False False True")]
)
def test_entry_imports_the_stack_frozen_for_the_commands_that_train_only(command: str, expected: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", AFTER_ENTRY.format(command=command)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == expected


@pytest.mark.slow  # starts processes
def test_the_bench_reports_both_variants_with_verdicts_from_its_own_rounds(tmp_path: Path) -> None:
    from omni_diffusion_rl.benchmarks.startup import VARIANTS, run_startup_bench

    output = tmp_path / "startup.json"
    result = run_startup_bench(output, repeats=1, pairs=("imports",))
    assert json.loads(output.read_text(encoding="utf-8")) == json.loads(json.dumps(result))
    assert output.with_suffix(".png").is_file()
    row = result["pairs"]["imports"]
    on, frozen = (row["each_round"][v] for v in VARIANTS)
    assert len(on) == len(frozen) == 1 and all(r["cpu_s"] > 0 and r["wall_s"] > 0 for r in on + frozen)
    for key in ("cpu_s", "wall_s"):  # every verdict recomputed from the rounds it reports
        expected = compare_paired([r[key] for r in frozen], [r[key] for r in on])
        assert row[f"frozen_vs_on_{key.removesuffix('_s')}"] == expected
    with pytest.raises(ValueError, match="choose among"):
        run_startup_bench(output, pairs=("everything",))
