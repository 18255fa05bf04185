"""Count the Python processes a test run starts and the CPU each spends (where the suite's time goes).

`install VENV` puts a start-up hook (a .pth file and its module) into VENV's site-packages. While
ODRL_PROC_LOG names a file, every interpreter of that venv then appends one JSON line at exit: its
command line, wall and CPU seconds, and the test that started it (PYTEST_CURRENT_TEST; tests/conftest.py
adds it to an environment a test built before it began, as helpers.ENV is). A process
ended by a signal (a server stopped with SIGTERM or SIGKILL) writes nothing, so the census counts
less than the total. `report LOG` groups the lines by command; `uninstall VENV` removes the hook.
Use a venv of its own (a clone's `make setup`), not the one you work in:

    .venv/bin/python -m tests.tools.process_census install /tmp/clone/.venv
    cd /tmp/clone && ODRL_PROC_LOG=/tmp/census.jsonl .venv/bin/python -m pytest -q -n 2 --dist loadfile
    .venv/bin/python -m tests.tools.process_census report /tmp/census.jsonl --output census.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
from collections import defaultdict
from pathlib import Path

HOOK_MODULE = "odrl_process_census"
HOOK = '''"""From tests/tools/process_census.py: a JSON line per interpreter exit, into ODRL_PROC_LOG."""
import atexit
import json
import os
import sys
import time

_log = os.environ.get("ODRL_PROC_LOG")
if _log:
    _started = time.time()

    def _write_census_line():
        times = os.times()
        line = {
            "argv": list(getattr(sys, "orig_argv", sys.argv))[1:5],
            "wall_s": round(time.time() - _started, 3),
            "cpu_s": round(times.user + times.system, 3),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "")[:200],
        }
        try:
            with open(_log, "a") as out:
                out.write(json.dumps(line) + "\\n")
        except OSError:
            pass

    atexit.register(_write_census_line)
'''


def site_packages(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.is_file():
        raise SystemExit(f"{venv} has no bin/python: give a venv folder (one `make setup` made)")
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    return Path(out.stdout.strip())


def install(venv: Path) -> None:
    target = site_packages(venv)
    (target / f"{HOOK_MODULE}.py").write_text(HOOK, encoding="utf-8")
    (target / f"{HOOK_MODULE}.pth").write_text(f"import {HOOK_MODULE}\n", encoding="utf-8")
    print(f"installed in {target}; set ODRL_PROC_LOG=FILE to record")


def uninstall(venv: Path) -> None:
    target = site_packages(venv)
    for suffix in (".py", ".pth"):
        (target / f"{HOOK_MODULE}{suffix}").unlink(missing_ok=True)
    print(f"removed from {target}")


def kind(argv: list[str]) -> str:
    """A command's kind: what it runs, without its arguments' values."""
    words = [w for w in argv if w not in ("-u", "-B")]
    if words[:1] == ["-m"] and len(words) > 1:
        name = words[1]
        if name == "omni_diffusion_rl.cli" and len(words) > 2 and not words[2].startswith("-"):
            return f"odrl {words[2]}"
        return f"-m {name}"
    if words[:1] == ["-c"]:
        return "pytest worker" if "exec(eval" in " ".join(words) else "-c ..."
    return Path(words[0]).name if words else "(interactive)"


def report(log: Path) -> dict[str, dict[str, float]]:
    """Per kind of command: how many processes, and their CPU and wall seconds in all."""
    rows = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    table: dict[str, dict[str, float]] = defaultdict(lambda: {"processes": 0, "cpu_s": 0.0, "wall_s": 0.0})
    for row in rows:
        entry = table[kind(row["argv"])]
        entry["processes"] += 1
        entry["cpu_s"] += row["cpu_s"]
        entry["wall_s"] += row["wall_s"]
    ordered = dict(sorted(table.items(), key=lambda item: -item[1]["cpu_s"]))
    print(f"{'command':<40} {'processes':>9} {'CPU s':>9} {'CPU s each':>11}")
    for name, entry in ordered.items():
        each = entry["cpu_s"] / entry["processes"]
        print(f"{name:<40} {entry['processes']:>9} {entry['cpu_s']:>9.1f} {each:>11.2f}")
    total = sum(e["cpu_s"] for e in ordered.values())
    print(f"{'all':<40} {sum(e['processes'] for e in ordered.values()):>9} {total:>9.1f}")
    return {name: {k: round(v, 3) for k, v in entry.items()} for name, entry in ordered.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("install", "uninstall"):
        sub.add_parser(name).add_argument("venv", type=Path)
    reporting = sub.add_parser("report")
    reporting.add_argument("log", type=Path)
    reporting.add_argument("--output", type=Path, help="write the table as JSON too")
    args = parser.parse_args()
    if args.command == "install":
        install(args.venv)
    elif args.command == "uninstall":
        uninstall(args.venv)
    else:
        table = report(args.log)
        if args.output:
            args.output.write_text(json.dumps(table, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
