"""Every command the README and the documentation show runs as written, in the environment `make
setup` makes.

The shell blocks of README.md and then of the documentation's pages, in the order of mkdocs.yml's
nav, are run one command at a time in a scratch copy of the working tree (its tracked files and
the untracked ones git does not ignore) with the setup's venv activated (its bin/ first on PATH), as
a user following the README and then the pages would after the README's first command: a page's
commands may use what the README's and earlier pages' commands made (the demo's run, a run a config
example trained). A ```python block whose first line is `# NAME.py` is written to that file first
(the rewards page's plug-in example). Every command runs until it ends, and passes when it
exits 0 with nothing that looks like an error in its output. No wall clock decides: commands whose
work is long as written (training runs, evaluations, cost measurement) get small overrides appended
(BOUNDED: fewer steps and samples, the same code paths), and SAFETY_S only stops a command that hangs.
A command that ends with `&` (a server) keeps running for the rest of its block, once it answers
/health, and is stopped at the block's end. A command shown in several places is written as a shell
block in one of them only (inline code elsewhere), so it runs once.

Skipped, each with its reason: `make test` (CI runs it; this test is part of it) and commands that
need what this machine does not have (GPUs, model weights under /models).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .helpers import REPO
from .test_docs import nav_pages

pytestmark = pytest.mark.slow

SAFETY_S = 900.0  # a hang, not a verdict on speed: the longest bounded command takes about a minute
_TRAIN = ["train.steps=2", "data.eval_samples=8", "sampling.num_steps=4", "sampling.eval_num_steps=4"]
_TRAIN += ["data.prompts_per_step=2", "data.group_size=4"]  # 8 samples a step: each prompt a group of 4
_EVAL = ["data.eval_samples=8", "sampling.eval_num_steps=4"]
BOUNDED = {  # command pattern -> what is appended to it (later overrides win over the README's own)
    r"^make demo\b": ["ARGS='" + " ".join(_TRAIN) + "'"],
    r"\bodrl train\b|recipes/train_nft\.py": _TRAIN,
    r"\bodrl eval\b": _EVAL,
    r"\bodrl simulate --measure\b": ["sampling.num_steps=2", "data.prompts_per_step=2", "data.group_size=2"],
}
SKIPS = {
    r"^make test\b": "CI runs it, and this check is part of it",
    r"--num_processes 8\b|cuda|recipes/configs/gpu_": "needs GPUs",
    r"/models/": "needs model weights that cannot be downloaded here",
}
# Pages whose commands tests/test_docs_commands.py runs, in a scratch copy of its own, so that the two
# halves run on two test workers (a page reads only what its own commands or prepare_checkpoints make).
LATER_PAGES = ("rewards.md", "execution-modes.md", "sharding.md", "multi-machine.md")
READS = {r"^make notebook\b": "runs/tiny_t2av_nft"}  # the run a command reads without naming it
ERROR_SIGNS = re.compile(r"Traceback \(most recent call last\)|\bError\b|No such file|command not found")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


@dataclass
class Command:
    text: str
    line: int
    background: bool


def readme_blocks(text: str) -> list[tuple[str, str, int]]:
    """(language, body, first line number) of every fenced block."""
    return [(m.group(1), m.group(2), text[: m.start()].count("\n") + 2) for m in FENCE.finditer(text)]


def shell_commands(body: str, first_line: int) -> list[Command]:
    """The commands of a shell block: continuation lines joined, comments and blank lines left out."""
    commands, pending, start = [], "", first_line
    for offset, raw in enumerate(body.splitlines()):
        line = raw.rstrip()
        if not pending:
            start = first_line + offset
            if not line.strip() or line.lstrip().startswith("#"):
                continue
        if line.endswith("\\"):
            pending += line[:-1].strip() + " "
            continue
        text = strip_comment(pending + line.strip())
        pending = ""
        background = text.endswith("&")
        commands.append(Command(text.rstrip("&").strip(), start, background))
    return commands


def strip_comment(line: str) -> str:
    """The command without a trailing ` # comment` (a # inside quotes is kept)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and i > 0 and line[i - 1].isspace():
            return line[:i].strip()
    return line.strip()


def skip_reason(command: str) -> str | None:
    return next((why for pattern, why in SKIPS.items() if re.search(pattern, command)), None)


def bounded(command: str) -> str:
    """The command with the overrides that bound its work appended (BOUNDED; the first match)."""
    extra = next((args for pattern, args in BOUNDED.items() if re.search(pattern, command)), [])
    return " ".join([command, *extra])


def wait_for_health(proc: subprocess.Popen[bytes], command: str) -> str:
    """A background server's outcome: it answers /health on its --port (polled until it does, it
    ends, or SAFETY_S), or a command without a port is left running."""
    import urllib.request

    port = re.search(r"--port (\d+)", command)
    if port is None:
        return "started in the background"
    url = f"http://127.0.0.1:{port.group(1)}/health"
    began = time.monotonic()
    while proc.poll() is None and time.monotonic() - began < SAFETY_S:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback only
                if answer.status == 200:
                    return "serving in the background"
        except OSError:
            time.sleep(0.5)
    return "ended" if proc.poll() is not None else f"no /health answer within {SAFETY_S:g} s (a hang?)"


def scratch_copy(dest: Path) -> Path:
    """The working tree's files (tracked, and untracked ones git does not ignore) under `dest`, with
    the setup's .venv linked in."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    (dest / ".venv").symlink_to(REPO / ".venv")
    return dest


def activated_env() -> dict[str, str]:
    venv = REPO / ".venv"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST", "ODRL_"))}
    env.update(PATH=f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}", VIRTUAL_ENV=str(venv))
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PYTHONHOME", None)
    return env


def start(command: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(
            ["bash", "-c", command],
            cwd=cwd,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGINT to the command's process group (a user's Ctrl-C), then SIGKILL if it lingers."""
    for sig, wait_s in ((signal.SIGINT, 15), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue
    try:  # anything it started in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def prepare_checkpoints(command: str, scratch: Path, env: dict[str, str]) -> list[str]:
    """Runs whose checkpoints a command reads (`runs/NAME/checkpoints`) and that earlier commands did
    not leave behind (they were stopped at the deadline): a one-step run of the README's config."""
    made = []
    runs = set(re.findall(r"\b(runs/[\w.\-]+)/checkpoints\b", command))
    runs |= {run for pattern, run in READS.items() if re.search(pattern, command)}
    for run in sorted(runs):
        if (scratch / run / "checkpoints" / "latest").is_file():
            continue
        quick = ["train.steps=1", "train.overwrite=true", "train.eval_at_start_and_end=false"]
        quick += [
            "train.preview_every=0",
            "train.progress=false",
            "data.prompts_per_step=2",
            "data.group_size=2",
        ]
        config = "recipes/configs/tiny_t2av_nft.yaml"
        done = subprocess.run(
            ["odrl", "train", config, f"train.output_dir={run}", *quick],
            cwd=scratch,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, f"preparing {run} for `{command}` failed:\n{done.stderr[-3000:]}"
        made.append(run)
    return made


def documents(scratch: Path) -> list[Path]:
    """README.md, then the documentation's pages in the order of mkdocs.yml's nav."""
    return [scratch / "README.md", *(scratch / "docs" / page for page in nav_pages(scratch / "mkdocs.yml"))]


def run_documents(files: list[Path], scratch: Path) -> list[dict[str, object]]:
    """Run every command of every file, in order; one record per command (ran / skipped, outcome,
    seconds, output tail)."""
    results: list[dict[str, object]] = []
    logs = scratch / ".readme_logs"
    logs.mkdir()
    for file in files:
        results += run_readme(file, scratch, logs)
    return results


def run_readme(readme: Path, scratch: Path, logs: Path) -> list[dict[str, object]]:
    """Run every command of one markdown file; one record per command."""
    env, results = activated_env(), []
    where = str(readme.relative_to(scratch))
    for language, body, first_line in readme_blocks(readme.read_text(encoding="utf-8")):
        if language == "python":
            name = re.match(r"#\s*(\S+\.py)\s*\n", body)
            if name:
                (scratch / name.group(1)).write_text(body, encoding="utf-8")
            continue
        if language not in ("bash", "sh"):
            continue
        background: list[subprocess.Popen[bytes]] = []
        try:
            for command in shell_commands(body, first_line):
                record: dict[str, object] = {"file": where, "line": command.line, "command": command.text}
                results.append(record)
                reason = skip_reason(command.text)
                if reason:
                    record.update(outcome="skipped", why=reason)
                    continue
                record["prepared"] = prepare_checkpoints(command.text, scratch, env)
                log = logs / f"{where.replace('/', '_')}_line_{command.line}.log"
                began = time.monotonic()
                ran = bounded(command.text)
                record["ran"] = ran
                proc = start(ran, scratch, env, log)
                if command.background:
                    background.append(proc)
                    record["outcome"] = wait_for_health(proc, ran)
                else:
                    try:
                        proc.wait(timeout=SAFETY_S)
                        record["outcome"] = f"exit {proc.returncode}"
                    except subprocess.TimeoutExpired:
                        record["outcome"] = f"did not end within {SAFETY_S:g} s (a hang?)"
                        record["output"] = log.read_text(encoding="utf-8", errors="replace")[-3000:]
                        stop(proc)
                record["seconds"] = round(time.monotonic() - began, 1)
                record.setdefault("output", log.read_text(encoding="utf-8", errors="replace")[-3000:])
        finally:
            for proc in background:
                stop(proc)
    return results


def failed(record: dict[str, object]) -> bool:
    outcome = str(record["outcome"])
    if outcome == "skipped":
        return False
    fine = outcome in ("exit 0", "serving in the background", "started in the background")
    return not fine or bool(ERROR_SIGNS.search(str(record.get("output", ""))))


def run_and_check(tmp_path: Path, pages: Callable[[Path], bool]) -> list[dict[str, object]]:
    """Run the commands of the README and the nav's pages that `pages` selects, in one scratch copy,
    print one line a command, and fail naming each command that failed with its output's tail."""
    if not (REPO / ".venv" / "bin" / "odrl").exists():
        pytest.fail("no .venv: run the README's setup (make setup) first")
    scratch = scratch_copy(tmp_path / "repo")
    results = run_documents([doc for doc in documents(scratch) if pages(doc)], scratch)
    print()
    for r in results:
        prepared = f" (after a one-step run into {', '.join(r['prepared'])})" if r.get("prepared") else ""
        what = r.get("ran", r["command"])
        print(f"{r['file']} line {r['line']}: {r['outcome']} ({r.get('seconds', '-')} s) {what}{prepared}")
    ran = [r for r in results if r["outcome"] != "skipped"]
    assert len(ran) >= 8, "the documentation's commands were not found"
    bad = [r for r in ran if failed(r)]
    assert not bad, "\n\n".join(f"{r['file']} line {r['line']}: {r.get('ran')}\n{r['output']}" for r in bad)
    return ran


def test_every_readme_command_runs_as_written(tmp_path: Path) -> None:
    """The README and the first pages; tests/test_docs_commands.py runs LATER_PAGES beside it."""
    ran = run_and_check(tmp_path, lambda doc: doc.name not in LATER_PAGES)
    assert any(r["file"] == "README.md" for r in ran), "the README's commands were not found"


def test_the_command_parser_joins_continuations_and_drops_comments() -> None:
    body = "# a comment\nodrl a \\\n  b   # the world's why\n\nserve x '#1' &\n"
    assert [(c.text, c.line, c.background) for c in shell_commands(body, 10)] == [
        ("odrl a b", 11, False),
        ("serve x '#1'", 14, True),
    ]
    assert skip_reason("make test") and skip_reason("odrl x --device cuda:0") and not skip_reason("make demo")
    assert bounded("odrl train cfg.yaml train.steps=20").endswith(
        "train.steps=20 train.steps=2 " + " ".join(_TRAIN[1:])
    )
    assert bounded("make demo") == "make demo ARGS='" + " ".join(_TRAIN) + "'"
    assert bounded("odrl probe-rewards") == "odrl probe-rewards"
