"""Held-out evaluation apart from the training reward: eval.metrics, `odrl eval`, the run summary."""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import pytest

from omni_diffusion_rl.config import ConfigError, config_from_dict, load_config
from omni_diffusion_rl.evaluation.heldout import heldout_prompts, prompt_groups, samples_of_rank
from omni_diffusion_rl.evaluation.targets import evaluate_target, target_config
from omni_diffusion_rl.trainers.trainer import Trainer
from omni_diffusion_rl.world import tiny_world as world

from . import plugin_rewards  # noqa: F401 - registers test_nan_on_red
from .helpers import ENV, REPO, fast_overrides, last_json_line, odrl, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def trained(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-step run with evaluation before and after; its output folder and summary."""
    out = tmp_path_factory.mktemp("run")
    cfg = load_config(None, [*fast_overrides(model_dir, out, 2), "data.eval_samples=32"])
    return out, Trainer(cfg).fit()


def test_held_out_groups_are_whole_prompts_on_every_rank() -> None:
    prompts = ["a", "b", "c"]
    assert prompt_groups(prompts, 7) == [[0, 3, 6], [1, 4], [2, 5]]
    assert heldout_prompts(prompts, 7) == ["a", "b", "c", "a", "b", "c", "a"]
    assert heldout_prompts(prompts, 4) == ["a", "b", "a", "b"]  # two samples a prompt at least
    assert heldout_prompts(prompts, 1) == ["a"]
    ranks = [samples_of_rank(prompts, 7, r, 2) for r in range(2)]
    assert sorted(ranks[0] + ranks[1]) == list(range(7))
    assert {i % 3 for i in ranks[0]} == {0, 2} and {i % 3 for i in ranks[1]} == {1}


def test_run_summary_leads_with_the_eval_metrics(trained: tuple[Path, dict]) -> None:
    _, summary = trained
    keys = list(summary)
    assert keys[:4] == [
        "heldout_all_correct_before",
        "heldout_all_correct_after",
        "heldout_tiny_world_judge_before",
        "heldout_tiny_world_judge_after",
    ]
    assert keys.index("heldout_reward_before") > 3
    after = summary["heldout_tiny_world_judge_after"]
    for name in ("color", "shape", "pitch", "timing", "flooded", "recognisable_shape", "diversity"):
        assert 0.0 <= after[name] <= 1.0, name
    assert after["failed_samples"] == 0.0
    assert 0.0 <= summary["heldout_all_correct_after"] <= 1.0


def test_eval_metrics_are_logged_but_not_trained_on(trained: tuple[Path, dict]) -> None:
    out, _ = trained
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert steps and not any(k.startswith("reward/tiny_world_judge") for r in steps for k in r)
    evals = [r for r in rows if "eval/tiny_world_judge" in r]
    assert [r["step"] for r in evals] == [0, 2]
    assert all("eval/tiny_world_judge/color" in r and "eval/reward" in r for r in evals)


def test_first_update_soft_updates_old_with_the_reference_decay(trained: tuple[Path, dict]) -> None:
    """The decay after the k-th optimizer update uses k (1-based), as the DiffusionNFT code does."""
    out, _ = trained
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    decays = [r["old_decay"] for r in rows if "old_decay" in r]
    assert decays == [pytest.approx(0.001), pytest.approx(0.002)]  # linear_to_0_5: 0.001 * k


def test_preview_index_has_eval_metrics_and_the_worlds_render(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(None, fast_overrides(model_dir, tmp_path / "run", 1))
    folder = Trainer(cfg).preview("step_00000")
    index = json.loads((folder / "index.json").read_text())
    assert index["reference"] is True
    sample = index["samples"][0]
    assert "tiny_world_judge/color" in sample["metrics"] and "reward" in sample["rewards"]
    assert (folder / sample["reference_gif"]).is_file()


@pytest.mark.slow
def test_odrl_eval_prints_a_table_and_json(
    model_dir: Path, trained: tuple[Path, dict], tmp_path: Path
) -> None:
    run, _ = trained
    out = tmp_path / "eval.json"
    proc = subprocess.run(
        odrl(
            "eval",
            "world",
            "base",
            str(run / "checkpoints"),
            f"model.pretrained={model_dir}",
            "data.eval_samples=32",
            "sampling.eval_num_steps=3",
            "--output",
            str(out),
        ),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    header = proc.stdout.splitlines()[0]
    assert "world" in header and "base" in header and "checkpoints" in header
    assert any(line.startswith("tiny_world_judge/shape ") for line in proc.stdout.splitlines())
    results = last_json_line(proc.stdout)
    assert json.loads(out.read_text()) == results
    assert results["world"]["tiny_world_judge"] == 1.0
    assert results["world"]["reward"] > 0.97
    assert set(results) == {"world", "base", str(run / "checkpoints")}
    for values in results.values():
        assert values["tiny_world_judge/failed_samples"] == 0.0


def test_eval_of_a_checkpoint_uses_its_model_and_the_given_eval_settings(trained: tuple[Path, dict]) -> None:
    run, _ = trained
    cfg = target_config(str(run / "checkpoints"), None, ["data.eval_samples=16", "eval.metrics=[]"])
    assert cfg.data.eval_samples == 16 and cfg.eval.metrics == []
    assert cfg.model.lora_rank == 4  # from the checkpoint
    result = evaluate_target(str(run / "checkpoints"), cfg)
    assert not any(k.startswith("tiny_world_judge") for k in result)
    assert 0.0 <= result["reward"] <= 1.0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("missing", "does not exist"),
        ("foreign", "neither a training checkpoint"),
        ("half", "not a complete checkpoint"),
    ],
)
def test_odrl_eval_refuses_missing_and_foreign_targets(tmp_path: Path, target: str, message: str) -> None:
    path = tmp_path / target
    if target == "foreign":
        path.mkdir()
        (path / "weights.bin").write_bytes(b"not ours")
    if target == "half":
        (path / "step_0000001").mkdir(parents=True)
        (path / "latest").write_text("step_0000001\n")
    proc = subprocess.run(
        odrl("eval", str(path)), cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_eval_metric_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["eval.metrics=[tiny_world_judgee]"])
    message = str(info.value)
    assert "eval.metrics: unknown scorer 'tiny_world_judgee'" in message
    assert "tiny_world_judge" in message and "color_match" in message


def test_the_tiny_world_judge_is_refused_for_other_models() -> None:
    with pytest.raises(ConfigError, match="tiny_world_judge judges the built-in tiny world"):
        load_config(None, ["model.family=sd3", "model.pretrained=/nowhere"])
    cfg = load_config(None, ["model.family=sd3", "model.pretrained=/nowhere", "eval.metrics=[clap]"])
    assert cfg.eval.metrics == ["clap"]


def test_a_metric_that_fails_on_some_samples_counts_them_and_never_scores_zero(model_dir: Path) -> None:
    cfg = load_config(
        None,
        [
            f"model.pretrained={model_dir}",
            "eval.metrics=[test_nan_on_red, tiny_world_judge]",
            "data.eval_samples=32",
            "sampling.eval_num_steps=2",
            "reward.plugins=[tests.plugin_rewards]",
        ],
    )
    result = evaluate_target("base", cfg)
    red = sum("red" in p for p in heldout_prompts(world.HELDOUT_PROMPTS, 32))
    assert 0 < red < 32
    assert result["test_nan_on_red/failed_samples"] == red
    assert result["test_nan_on_red"] == 1.0  # the mean of the samples it could score, not a 0 for the rest
    assert result["tiny_world_judge/failed_samples"] == 0.0
    assert not math.isnan(result["tiny_world_judge"])


def test_a_reward_that_fails_on_a_preview_sample_is_shown_as_failed(model_dir: Path, tmp_path: Path) -> None:
    overrides = [
        *fast_overrides(model_dir, tmp_path / "run", 1),
        "reward.weights={color_match: 1.0, test_nan_on_red: 1.0}",
        "reward.plugins=[tests.plugin_rewards]",
        "data.eval_prompts=builtin:tiny_world_heldout",
    ]
    folder = Trainer(load_config(None, overrides)).preview("step_00000")
    index = json.loads((folder / "index.json").read_text())
    values = [s["rewards"]["reward/test_nan_on_red"] for s in index["samples"]]
    assert None in values, "red prompts are among the preview prompts"
    assert all(v in (None, 1.0) for v in values)


def test_positional_words_after_an_option_are_kept() -> None:
    from omni_diffusion_rl.cli import parse_args

    args = parse_args(["eval", "base", "--no-reward", "data.eval_samples=32", "world"])
    assert args.targets == ["base", "data.eval_samples=32", "world"] and args.no_reward
    args = parse_args(["train", "cfg.yaml", "--resume", "runs/x", "train.steps=3"])
    assert args.overrides == ["train.steps=3"] and args.resume == "runs/x"
    with pytest.raises(SystemExit):
        parse_args(["eval", "base", "--no-reward", "--bogus"])


class _Payload:
    """Unpickling this creates the file its path names: the proof that a load ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):  # noqa: ANN204 - pickle protocol
        return (Path.touch, (Path(self.path),))


def test_sampling_evaluating_and_resuming_a_checkpoint_never_unpickle_it(
    trained: tuple[Path, dict], tmp_path: Path
) -> None:
    import hashlib
    import shutil

    import torch

    from omni_diffusion_rl.checkpoint import MANIFEST, resolve_checkpoint
    from omni_diffusion_rl.inference import load_policy

    shared = tmp_path / "shared"
    shutil.copytree(resolve_checkpoint(trained[0] / "checkpoints"), shared)
    marker = tmp_path / "ran"
    torch.save({"optimizer": _Payload(str(marker))}, shared / "objects.pt")
    manifest = json.loads((shared / MANIFEST).read_text())  # a forger recomputes the hash too
    data = (shared / "objects.pt").read_bytes()
    manifest["files"]["objects.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (shared / MANIFEST).write_text(json.dumps(manifest))
    load_policy(shared)
    target_config(str(shared), None, ["data.eval_samples=4"])
    state = json.loads((shared / "state.json").read_text())
    trainer = Trainer(config_from_dict({**state["config"], "train": {"output_dir": str(tmp_path / "r")}}))
    trainer.load(shared)  # --resume reads the training state from JSON + safetensors
    assert trainer.step == state["step"] and trainer.optimizer.state_dict()["state"]
    assert not marker.exists()


def test_a_metric_without_a_headline_keeps_its_score_in_the_summary() -> None:
    from omni_diffusion_rl.evaluation.heldout import MetricScorer, before_after_summary

    class Plain:
        def score(self, media, prompts):  # noqa: ANN001, ANN202
            raise AssertionError("not called")

    metric = MetricScorer("plain", Plain(), "plain")
    summary = before_after_summary({"plain": 0.5, "plain/x": 0.2}, {"plain": float("nan")}, [metric])
    assert summary["heldout_plain_before"] == {"score": 0.5, "x": 0.2}
    assert summary["heldout_plain_after"] == {"score": None}


def test_a_metric_that_is_also_trained_on_is_refused() -> None:
    with pytest.raises(ConfigError, match="also in reward.weights"):
        load_config(None, ["eval.metrics=[color_match]"])


def test_bad_metric_options_are_a_config_error(model_dir: Path) -> None:
    from omni_diffusion_rl.evaluation.heldout import build_metrics

    with pytest.raises(ConfigError, match="eval.options.tiny_world_judge"):
        build_metrics(["tiny_world_judge"], {"tiny_world_judge": {"no_such_option": 1}})
