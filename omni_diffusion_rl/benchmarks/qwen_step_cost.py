"""`odrl bench qwen-step`: whole GSPO steps of the Qwen2.5-Omni recipe, at an older commit and now,
side by side in one run.

Both run `recipes/configs/qwen2_5_omni_avqa_gspo.yaml` as shipped (16 questions x 8 answers a step,
micro-batches of 4, the shipped example set at Qwen's clip format: 4-second clips with 16 kHz sound,
224 x 224 frames at 2 fps) on one process, with a tiny random-init thinker that carries
Qwen2.5-Omni-7B's processors (128 mels, 300-second chunks, its pixel bounds; `tiny_qwen`, `seven_b`).
Only what a CPU cannot run is changed: fp32 instead of bf16, no checkpoints, previews or held-out
evaluation. The older commit's code is unpacked with `git archive` into a temporary folder (the
checkout is not touched) and run with the same Python and packages.

Per run: the seconds of each step's rollout and training (the trainer's own `time/` records), the
answers' mean length (sampling time grows with it) and the process's peak resident memory. Runs
alternate (before, now, now, before, ...). Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path
from statistics import median
from typing import Any

from .common import machine_info, publish

BEFORE = "480645a7f5814290d762dfec916b8bf7fc5a6f05"  # the commit before issue 46's five cost changes
RECIPE = "recipes/configs/qwen2_5_omni_avqa_gspo.yaml"
EXAMPLE_SET = "recipes/data/qwen_avqa_files/questions.jsonl"
PARTS = ("rollout", "reward_wait", "train")  # a step's parts, as the trainer records them
RUNNER = """
import json, resource, sys
from omni_diffusion_rl.cli import main
code = main(sys.argv[1:])
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
print("QWEN_STEP_PEAK " + json.dumps({"exit": code, "peak_mib": peak / 1024}))
"""


def checkout_root(start: Path) -> Path:
    """The root of the git checkout holding `start` (git archive packs only the folder it runs in)."""
    found = subprocess.run(
        ["git", "-C", str(start), "rev-parse", "--show-toplevel"], capture_output=True, text=True, check=False
    )
    if found.returncode:
        raise ValueError(f"{start} is not in a git checkout: run odrl bench qwen-step in the project's clone")
    return Path(found.stdout.strip())


def commit_id(repo: Path, commit: str) -> str:
    """`commit`'s full id in `repo`, or a ValueError naming it (an option-like value is refused)."""
    asked = ["rev-parse", "--verify", "--quiet", "--end-of-options", f"{commit}^{{commit}}"]
    found = subprocess.run(
        ["git", "-C", str(repo), *asked],
        capture_output=True,
        text=True,
        check=False,
    )
    if found.returncode or commit.startswith("-"):
        raise ValueError(
            f"git archive {commit}: no such commit in {repo} (a shallow clone lacks older commits: "
            "`git fetch --unshallow` first)"
        )
    return found.stdout.strip()


def unpack_commit(repo: Path, commit: str, into: Path) -> Path:
    """The tree of `commit` written into `into` (git archive: the checkout is left as it is)."""
    made = subprocess.run(
        ["git", "-C", str(repo), "archive", "--format=tar", commit_id(repo, commit)],
        capture_output=True,
        check=False,
    )
    if made.returncode:
        raise ValueError(f"git archive {commit} in {repo}: {made.stderr.decode(errors='replace').strip()}")
    safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python 3.11.4+, 3.10.12+
    with tarfile.open(fileobj=BytesIO(made.stdout)) as tar:
        tar.extractall(into, **safe)  # a commit of the checkout itself; filtered where Python can
    return into


def run_overrides(model: Path, questions: Path, output_dir: Path, steps: int) -> list[str]:
    """The recipe's keys a CPU run changes: the model folder, fp32, nothing written but the records."""
    return [
        f"model.pretrained={model}",
        "model.base_dtype=fp32",
        f"data.prompts={questions}",
        f"data.eval_prompts={questions}",
        f"train.steps={steps}",
        f"train.output_dir={output_dir}",
        "train.mixed_precision=fp32",
        "train.preview_every=0",
        f"train.checkpoint_every={steps + 1}",
        "train.eval_at_start_and_end=false",
        "train.progress=false",
        "tracking.wandb=false",
    ]


def run_steps(code: Path, overrides: list[str], output_dir: Path) -> dict[str, Any]:
    """One training process of `code`'s package: its steps' seconds and its peak memory."""
    env = os.environ | {"PYTHONPATH": str(code), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, "train", RECIPE, *overrides],
        cwd=code,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    marks = [line for line in done.stdout.splitlines() if line.startswith("QWEN_STEP_PEAK ")]
    if done.returncode or not marks or json.loads(marks[-1].split(" ", 1)[1])["exit"]:
        raise RuntimeError(f"the run of {code} failed:\n{done.stdout[-1500:]}\n{done.stderr[-3000:]}")
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "time/rollout_s" in r]
    return {
        "rollout_s": [round(r["time/rollout_s"], 3) for r in steps],
        "train_s": [round(r["time/train_s"], 3) for r in steps],
        "step_s": [round(sum(r[f"time/{part}_s"] for part in PARTS), 3) for r in steps],
        "peak_mib": round(json.loads(marks[-1].split(" ", 1)[1])["peak_mib"], 1),
        "answer_tokens": [round(r["answers/mean_tokens"], 2) for r in steps],  # the decode's length
    }


def run_qwen_step_bench(
    output: Path, repo: Path, before: str = BEFORE, steps: int = 2, rounds: int = 1
) -> dict[str, Any]:
    """`rounds` runs of `steps` steps each at `before` and at `repo`'s working tree, alternating."""
    from .tiny_qwen import save_tiny_qwen_omni

    repo = checkout_root(repo)
    questions = repo / EXAMPLE_SET
    if not (repo / RECIPE).is_file() or not questions.is_file():
        raise ValueError(f"{repo} lacks {RECIPE} or {EXAMPLE_SET}")
    runs: dict[str, list[dict[str, Any]]] = {"before": [], "now": []}
    with tempfile.TemporaryDirectory(prefix="qwen_step_") as scratch:
        work = Path(scratch)
        trees = {"before": unpack_commit(repo, before, work / "before"), "now": repo}
        model = save_tiny_qwen_omni(work / "model", seven_b=True)
        pairs = [("before", "now") if r % 2 == 0 else ("now", "before") for r in range(rounds)]
        order = [name for pair in pairs for name in pair]
        for i, name in enumerate(order):
            run_dir = work / f"run_{i}_{name}"
            print(f"qwen-step: run {i + 1} of {len(order)} ({name})", file=sys.stderr, flush=True)
            overrides = run_overrides(model, questions, run_dir, steps)
            runs[name].append(run_steps(trees[name], overrides, run_dir))
    summary = {name: _summary(done) for name, done in runs.items()}
    result = {
        "machine": machine_info(),
        "before_commit": commit_id(repo, before),
        "now_commit": commit_id(repo, "HEAD"),
        "now_uncommitted_changes": _dirty(repo),
        "recipe": RECIPE,
        "questions": EXAMPLE_SET,
        "steps_per_run": steps,
        "rounds": rounds,
        "runs": runs,
        "summary": summary,
        "ratio": {key: _ratio(summary, key) for key in ("step_s", "rollout_s", "train_s", "peak_mib")},
    }
    publish(result, output, format_table(result), _draw, (8.0, 3.5), panels=2)
    return result


def _dirty(repo: Path) -> bool:
    status = subprocess.run(["git", "-C", str(repo), "status", "--porcelain"], capture_output=True, text=True)
    return bool(status.stdout.strip())


def _summary(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over the runs' steps after each run's first (the first when a run has one step)."""

    def steady(key: str) -> float:
        values = [v for run in runs for v in (run[key][1:] or run[key])]
        return round(median(values), 3)

    return {
        "step_s": steady("step_s"),
        "rollout_s": steady("rollout_s"),
        "train_s": steady("train_s"),
        "peak_mib": round(median(run["peak_mib"] for run in runs), 1),
    }


def _ratio(summary: dict[str, dict[str, float]], key: str) -> float:
    now = summary["now"][key]
    return round(summary["before"][key] / now, 2) if now else float("inf")


def format_table(result: dict[str, Any]) -> str:
    s, ratio = result["summary"], result["ratio"]
    labels = {
        "step_s": "a step: seconds",
        "rollout_s": "  its rollout (128 answers): seconds",
        "train_s": "  its training (32 micro-batches): seconds",
        "peak_mib": "the process's peak memory: MiB",
    }
    rows = [f"{'':<44}{'before':>12}{'now':>12}{'before/now':>12}"]
    rows += [f"{label:<44}{s['before'][k]:>12}{s['now'][k]:>12}{ratio[k]:>12}" for k, label in labels.items()]
    return "\n".join(rows)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    s = result["summary"]
    for ax, (key, title) in zip(axes, (("step_s", "seconds a step"), ("peak_mib", "peak MiB")), strict=True):
        ax.bar(["before", "now"], [s["before"][key], s["now"][key]], color=["#999999", "#3366cc"])
        ax.set_title(title)
