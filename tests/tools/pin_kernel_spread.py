"""Measure how far each pinned run moves when torch's CPU kernels change (the pins' step-1 tolerance).

Runs every pin of tests/test_behaviour_fixture.py once per ATEN_CPU_CAPABILITY (default, avx2,
avx512: the ones this CPU has), then prints, per pin and step, the largest relative difference of a
logged value between kernels, and writes the table as JSON. Run from the repository root:

    .venv/bin/python -m tests.tools.pin_kernel_spread --output runs/bench/pin_kernel_spread.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.test_behaviour_fixture import ABS_FLOOR, EXACT_KEYS, PINS, _train

KERNELS = ("default", "avx2", "avx512")


def largest_gaps(runs: list[list[dict[str, float]]]) -> list[tuple[float, str]]:
    """Per step: the largest relative gap between any run and the first, and the value it was in."""
    gaps = []
    for rows in zip(*runs, strict=True):
        worst, where = 0.0, ""
        for key, want in rows[0].items():
            if key.startswith(EXACT_KEYS) or not isinstance(want, float):
                continue
            for row in rows[1:]:
                gap = abs(row[key] - want) / max(abs(want), ABS_FLOOR)
                if abs(row[key] - want) > ABS_FLOOR and gap > worst:
                    worst, where = gap, key
        gaps.append((worst, where))
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=Path("runs/bench/pin_kernel_spread.json"))
    parser.add_argument("--pins", default=",".join(PINS), help="comma-separated pin names")
    args = parser.parse_args()
    report: dict[str, list[dict[str, object]]] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.pins.split(","):
            runs = [_train(name, Path(scratch) / f"{name}_{k}", {"ATEN_CPU_CAPABILITY": k}) for k in KERNELS]
            gaps = largest_gaps(runs)
            report[name] = [{"step": i + 1, "largest_rel_gap": g, "key": k} for i, (g, k) in enumerate(gaps)]
            for row in report[name]:
                print(
                    f"{name:>10}  step {row['step']}  {row['largest_rel_gap']:.2e}  {row['key']}", flush=True
                )
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"kernels": KERNELS, "pins": report}, indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
