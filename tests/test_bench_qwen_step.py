"""`odrl bench qwen-step`: the shipped Qwen2.5-Omni recipe on its shipped example set, run as the
benchmark runs it (a separate process of a package tree, with Qwen2.5-Omni-7B's processors on a tiny
thinker), and the older commit's tree unpacked without touching the checkout."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from omni_diffusion_rl.benchmarks.qwen_step_cost import (
    EXAMPLE_SET,
    RECIPE,
    format_table,
    run_overrides,
    run_steps,
    unpack_commit,
)
from omni_diffusion_rl.config import load_config

REPO = Path(__file__).resolve().parent.parent


def test_the_benchmarks_overrides_change_only_what_a_cpu_cannot_run(tmp_path: Path) -> None:
    shipped = load_config(REPO / RECIPE)
    overrides = run_overrides(tmp_path / "model", tmp_path / "q.jsonl", tmp_path / "run", 2)
    changed = load_config(REPO / RECIPE, overrides)
    assert (changed.model.base_dtype, changed.train.mixed_precision) == ("fp32", "fp32")
    for kept in ("prompts_per_step", "group_size", "clip_fps", "clip_seconds", "clip_sample_rate"):
        assert getattr(changed.data, kept) == getattr(shipped.data, kept), kept
    assert changed.train.micro_batch_size == shipped.train.micro_batch_size
    assert changed.algorithm == shipped.algorithm and changed.model.options == shipped.model.options
    assert changed.train.checkpoint_every > changed.train.steps and not changed.train.eval_at_start_and_end


@pytest.mark.slow  # git processes
def test_an_older_commit_is_unpacked_beside_the_checkout_and_a_missing_one_is_named(tmp_path: Path) -> None:
    status = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    tree = unpack_commit(REPO, "HEAD", tmp_path / "head")
    assert (tree / "omni_diffusion_rl" / "cli" / "main.py").is_file() and (tree / RECIPE).is_file()
    after = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True)
    assert after.stdout == status.stdout  # the checkout untouched
    with pytest.raises(ValueError, match="git archive 0{40}: no such commit"):
        unpack_commit(REPO, "0" * 40, tmp_path / "none")
    with pytest.raises(ValueError, match="no such commit"):  # not read as an option of git's
        unpack_commit(REPO, "--output=/tmp/x", tmp_path / "none")
    from omni_diffusion_rl.cli import main

    output = tmp_path / "bench.json"
    assert main(["bench", "qwen-step", "--before", "no-such-commit", "--output", str(output)]) == 2
    assert not output.exists()


def test_the_summary_takes_steady_steps_and_the_ratio_divides_before_by_now() -> None:
    """Each run's first step is left out where a run has more (warm-up), medians over the rest."""
    from omni_diffusion_rl.benchmarks.qwen_step_cost import _ratio, _summary

    def run(steps: list[float], peak: float) -> dict:
        return {"step_s": steps, "rollout_s": steps, "train_s": steps, "peak_mib": peak}

    before = _summary([run([99.0, 10.0], 900.0), run([98.0, 12.0], 1100.0)])
    now = _summary([run([50.0, 2.0], 300.0)])
    assert before["step_s"] == 11.0 and now["step_s"] == 2.0 and before["peak_mib"] == 1000.0
    assert _summary([run([7.0], 1.0)])["step_s"] == 7.0  # a one-step run keeps its step
    summary = {"before": before, "now": now}
    ratio = {key: _ratio(summary, key) for key in before}
    assert ratio["step_s"] == 5.5 and ratio["peak_mib"] == pytest.approx(3.33, abs=0.01)
    table = format_table({"summary": summary, "ratio": ratio})
    assert table.splitlines()[1].split()[-3:] == ["11.0", "2.0", "5.5"]


@pytest.mark.slow  # a training process of its own
def test_the_shipped_qwen_recipe_trains_a_step_on_its_shipped_example_set(tmp_path: Path) -> None:
    """The real recipe's clip format (4 s, 16 kHz sound inside 224 x 224 MP4s at 2 fps) on a thinker
    with the 7B's processors: a step trains (smaller than the recipe's), its times and memory read."""
    from omni_diffusion_rl.benchmarks.tiny_qwen import save_tiny_qwen_omni

    model = save_tiny_qwen_omni(tmp_path / "model", seven_b=True)
    run = tmp_path / "run"
    overrides = run_overrides(model, REPO / EXAMPLE_SET, run, 1)
    small = ["data.prompts_per_step=2", "data.group_size=2", "train.micro_batch_size=2"]
    result = run_steps(REPO, [*overrides, *small], run)
    assert len(result["step_s"]) == 1 and result["step_s"][0] > 0 and result["peak_mib"] > 100
