"""End-to-end trainer tests: resume equality, several processes, bad checkpoints."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.runtime.subprocesses import run_process_tree
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import ENV, REPO, fast_overrides, last_json_line, odrl, step_records, tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def _train(model_dir: Path, out: Path, steps: int, *extra: str) -> Trainer:
    cfg = load_config(None, fast_overrides(model_dir, out, steps) + list(extra))
    trainer = Trainer(cfg)
    trainer.summary = trainer.fit()
    return trainer


def test_training_changes_trained_adapter_and_soft_updates_old(model_dir: Path, tmp_path: Path) -> None:
    trainer = _train(model_dir, tmp_path / "run", 2)
    from omni_diffusion_rl.models import lora

    default = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    old = lora.adapter_state_dict(trainer.transformer, lora.OLD)
    old = {k.replace(".old.", ".default."): v for k, v in old.items()}
    lora_b = [k for k in default if "lora_B" in k]
    assert any(default[k].abs().sum() > 0 for k in lora_b), "lora_B starts at 0 and must move"
    # linear_to_0_5 at steps 0 and 1 gives decays 0 and 0.001: old trails default but stays close.
    assert any(not torch.equal(default[k], old[k]) for k in lora_b)
    assert all(torch.allclose(default[k], old[k], atol=1e-3) for k in default)
    rows = step_records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    assert (tmp_path / "run" / "reward_curve.png").stat().st_size > 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert 0.0 <= summary["heldout_reward_after"] <= 1.0


def test_per_reward_advantages_reach_the_update_and_change_what_is_learned(
    model_dir: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.models import lora
    from omni_diffusion_rl.trainers.update_batch import UpdateBatch

    seen: list[UpdateBatch] = []
    runs = {}
    for per_reward in (False, True):
        cfg = load_config(
            None,
            fast_overrides(model_dir, tmp_path / str(per_reward), 1)
            + ["data.group_size=4", f"algorithm.adv_per_reward={str(per_reward).lower()}"],
        )
        trainer = Trainer(cfg)
        update = trainer.algorithm.update
        trainer.algorithm.update = lambda batch, update=update: seen.append(batch) or update(batch)
        trainer.fit()
        runs[per_reward] = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    batch = seen[-1]
    assert sorted(batch.parts) == sorted(batch.weights) == sorted(load_config(None, []).reward.weights)
    assert all(len(v) == len(batch.rewards) for v in batch.parts.values())
    # The two batches are the same samples (same seed), so the difference is the advantages alone.
    assert torch.equal(seen[0].rewards, seen[1].rewards)
    per_reward, summed = batch.advantages(per_reward=True), batch.advantages()
    assert not torch.allclose(per_reward, summed, atol=1e-3)
    assert any(not torch.equal(runs[False][k], runs[True][k]) for k in runs[True])
    bare = UpdateBatch(batch.rollout, batch.rewards, batch.groups, batch.keep, batch.local, 0)
    with pytest.raises(ValueError, match="per-reward advantages need each weighted reward's scores"):
        bare.advantages(per_reward=True)


def test_timestep_choice_noisiest_reaches_the_plan(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        fast_overrides(model_dir, tmp_path / "run", 1)
        + ["algorithm.timestep_choice=noisiest", "algorithm.timestep_fraction=0.7"],
    )
    trainer = Trainer(cfg)
    plans = []
    plan = trainer.algorithm.plan
    trainer.algorithm.plan = lambda batch: plans.append(plan(batch)) or plans[-1]
    trainer.fit()
    times = [t for t, _, _ in plans[0].data["inputs"]]
    assert len(times) == 2  # 0.7 of 3 steps
    assert all(torch.equal(t, t[:1].expand_as(t)) for t in times)  # every sample trains the same times
    firsts = [float(t[0]) for t in times]
    assert firsts[0] == 1.0 and firsts == sorted(firsts, reverse=True)  # from pure noise down


@pytest.mark.slow  # starts training or launcher processes
def test_resume_after_kill_replays_the_uninterrupted_run(model_dir: Path, tmp_path: Path) -> None:
    steps = 6
    reference = tmp_path / "reference"
    _train(model_dir, reference, steps, "train.checkpoint_every=2")

    interrupted = tmp_path / "interrupted"
    args = odrl("train", *fast_overrides(model_dir, interrupted, steps), "train.checkpoint_every=2")
    proc = subprocess.Popen(args, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        marker = interrupted / "checkpoints" / "step_0000002" / "manifest.json"
        while not marker.exists():
            assert proc.poll() is None, proc.stderr.read().decode()
            assert time.time() < deadline, "no checkpoint within 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (interrupted / "summary.json").exists(), "the run finished before it could be interrupted"

    resumed = subprocess.run(
        odrl(
            "train",
            *fast_overrides(model_dir, interrupted, steps),
            "train.checkpoint_every=2",
            "--resume",
            str(interrupted / "checkpoints"),
        ),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr
    assert step_records(interrupted) == step_records(reference)
    ref_summary = json.loads((reference / "summary.json").read_text())
    assert last_json_line(resumed.stdout)["heldout_reward_after"] == ref_summary["heldout_reward_after"]


@pytest.mark.slow  # starts training or launcher processes
def test_two_processes_match_one_process(model_dir: Path, tmp_path: Path) -> None:
    """Prompt groups spread over 2 ranks: same rewards, advantages and updates as 1 process."""
    single = tmp_path / "single"
    _train(model_dir, single, 2)
    double = tmp_path / "double"
    env = {**ENV, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
    proc = run_process_tree(  # `odrl train --nproc 2` starts its processes itself
        odrl("train", "--nproc", "2", *fast_overrides(model_dir, double, 2)), timeout_s=300, env=env, cwd=REPO
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows_1, rows_2 = step_records(single), step_records(double)
    assert len(rows_2) == 2
    for a, b in zip(rows_1, rows_2, strict=True):
        assert a["reward/mean"] == pytest.approx(b["reward/mean"], abs=1e-5)
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-4, abs=1e-6)
    assert last_json_line(proc.stdout)["heldout_reward_after"] == pytest.approx(
        json.loads((single / "summary.json").read_text())["heldout_reward_after"], abs=1.5e-4
    )  # 4 digits kept: one rounding step apart at most


@pytest.mark.parametrize("damage", ["missing", "no_manifest", "truncated", "other_model"])
def test_bad_checkpoints_are_refused(model_dir: Path, tmp_path: Path, damage: str) -> None:
    run = tmp_path / "run"
    _train(model_dir, run, 1, "train.eval_at_start_and_end=false")
    ckpt = run / "checkpoints" / "step_0000001"
    overrides = fast_overrides(model_dir, tmp_path / "again", 2) + ["train.eval_at_start_and_end=false"]
    if damage == "missing":
        ckpt = tmp_path / "nowhere"
    elif damage == "no_manifest":
        (ckpt / "manifest.json").unlink()
    elif damage == "truncated":
        data = (ckpt / "tensors.safetensors").read_bytes()
        (ckpt / "tensors.safetensors").write_bytes(data[: len(data) // 2])
    else:
        overrides.append("model.lora_rank=8")
    trainer = Trainer(load_config(None, overrides))
    with pytest.raises(CheckpointError) as info:
        trainer.fit(resume=str(ckpt))
    message = str(info.value)
    expected = {
        "missing": "does not exist",
        "no_manifest": "not a complete checkpoint",
        "truncated": "truncated or corrupted",
        "other_model": "another model configuration",
    }[damage]
    assert expected in message
    assert not list((tmp_path / "again").glob("checkpoints/step_*")), "a refused resume must write nothing"


def test_a_reward_that_returns_nan_stops_training_without_a_partial_checkpoint(
    model_dir: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.registry import rewards
    from omni_diffusion_rl.reward import RewardError

    @rewards.register("test_nan_on_second_call", overwrite=True)
    class NanOnSecondCall:
        calls = 0

        def score(self, media, prompts):  # noqa: ANN001, ANN202
            NanOnSecondCall.calls += 1
            scores = torch.rand(len(prompts))
            return scores if NanOnSecondCall.calls == 1 else scores * float("nan")

    run = tmp_path / "run"
    overrides = fast_overrides(model_dir, run, 3) + [
        "reward.weights={test_nan_on_second_call: 1.0}",
        "train.eval_at_start_and_end=false",
        "train.checkpoint_every=1",
    ]
    with pytest.raises(RewardError, match="test_nan_on_second_call.*non-finite"):
        Trainer(load_config(None, overrides)).fit()
    checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert checkpoints == ["latest", "step_0000001"], "only the completed step may be saved"
    assert [r["step"] for r in step_records(run)] == [1]
