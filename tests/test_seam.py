"""The algorithm/execution seam: an algorithm runs against a fake experience source, and the
colocated source against a fake algorithm, each through the one training loop."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.experience.rollout import Rollout
from omni_diffusion_rl.experience.sampling import time_grid
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.registry import algorithms
from omni_diffusion_rl.reward import ScoreResult
from omni_diffusion_rl.trainers.nft import DiffusionNFT
from omni_diffusion_rl.trainers.skeleton import Algorithm, UpdateBatch
from omni_diffusion_rl.trainers.sources import ExperienceSource, LocalSource
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, step_records, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


class ListSource(ExperienceSource):
    """Hand-made batches: 2 groups of 2 per step with fixed rewards; sample 1 of every step failed
    scoring. Records what the loop tells it."""

    def __init__(self) -> None:
        self.told: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.started = self.finished = 0

    def start(self) -> None:
        self.started += 1

    def next_batch(self, step: int) -> tuple[Rollout, ScoreResult]:
        policy = self.context.experience.policy
        prompts = ["a red circle", "a red circle", "a blue square", "a blue square"]
        x0 = torch.randn((4, *policy.latent_shape), generator=torch.Generator().manual_seed(step))
        rollout = Rollout(
            prompts=prompts,
            group_ids=torch.tensor([0, 0, 1, 1]) + 2 * step,
            x0=x0,
            cond=policy.encode_prompts(prompts),
            grid=time_grid(3),
        )
        total = torch.tensor([0.2, float("nan"), 0.9, 0.1])
        return rollout, ScoreResult(total, {"fixed": total.clone()}, {1: "the fixed reward failed"})

    def after_step(self, ok: torch.Tensor, keep: torch.Tensor) -> dict[str, float]:
        self.told.append((ok.clone(), keep.clone()))
        return {"source/told": float(len(self.told))}

    def finish(self) -> dict[str, Any]:
        self.finished += 1
        return {"list_source": {"batches": len(self.told)}}

    def state_dict(self) -> dict[str, Any]:
        return {"list_source": {"told": len(self.told)}}


def test_an_algorithm_learns_from_a_fake_source_and_the_source_hears_every_samples_fate(
    model_dir: Path, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    overrides = [*fast_overrides(model_dir, run, 2), "train.eval_at_start_and_end=false"]
    source = ListSource()
    trainer = Trainer(load_config(None, overrides), source=source)
    assert isinstance(trainer.algorithm, DiffusionNFT)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    summary = trainer.fit()
    assert (source.started, source.finished) == (1, 1)
    # sample 1 failed; its group mate 0 is left alone in its group, so it is not trained either
    assert [(ok.tolist(), keep.tolist()) for ok, keep in source.told] == [
        ([True, False, True, True], [False, False, True, True])
    ] * 2
    assert summary["list_source"] == {"batches": 2}
    assert summary["samples"] == {
        "generated": 8,
        "trained": 4,
        "dropped/reward_failed": 2,
        "dropped/group_too_small": 2,
    }
    rows = step_records(run)
    assert [r["source/told"] for r in rows] == [1.0, 2.0]
    assert all(r["reward/mean"] == pytest.approx(0.5) for r in rows), "the trained samples' rewards"
    trained = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    assert any(not torch.equal(before[k], trained[k]) for k in trained), "the algorithm updated"
    failed = [json.loads(line) for line in (run / "failed_samples.jsonl").read_text().splitlines()]
    assert [f["reason"] for f in failed] == [
        "its prompt group has fewer than 2 scored samples",  # sample 0
        "the fixed reward failed",  # sample 1
    ] * 2
    state = json.loads((run / "checkpoints" / "step_0000002" / "state.json").read_text())
    assert state["list_source"] == {"told": 2}, "the source's state is in the checkpoint"


class RecordingAlgorithm(Algorithm):
    """Records every update's inputs and makes no change; counts generation under its rollout
    weights."""

    rollout_entries = 0
    updates: list[dict[str, Any]] = []

    @staticmethod
    def rollout_weights(transformer: torch.nn.Module) -> contextlib.AbstractContextManager[object]:
        RecordingAlgorithm.rollout_entries += 1
        return contextlib.nullcontext()

    def metric_names(self) -> list[str]:
        return ["loss/total"]

    def update(self, batch: UpdateBatch) -> dict[str, float]:
        RecordingAlgorithm.updates.append(
            {
                "rewards": batch.rewards.clone(),
                "groups": batch.groups.tolist(),
                "keep": batch.keep.tolist(),
                "step": batch.step,
            }
        )
        out = self.learner.weighted_mean_over_ranks(
            {"loss/total": 0.0}, float(len(batch.rollout)), ["loss/total"]
        )
        self.learner.apply_gradients(out)
        return out


@pytest.fixture
def recording(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[RecordingAlgorithm]]:
    monkeypatch.setitem(algorithms._factories, "recording", RecordingAlgorithm)  # noqa: SLF001
    RecordingAlgorithm.rollout_entries, RecordingAlgorithm.updates = 0, []
    yield RecordingAlgorithm


def test_the_colocated_source_feeds_any_algorithm_with_its_rollout_weights(
    model_dir: Path, tmp_path: Path, recording: type[RecordingAlgorithm]
) -> None:
    run = tmp_path / "run"
    overrides = [
        *fast_overrides(model_dir, run, 3),
        "train.eval_at_start_and_end=false",
        "algorithm.name=recording",
        "sampling.rollout_chunks=2",
    ]
    trainer = Trainer(load_config(None, overrides))
    assert isinstance(trainer.source, LocalSource) and isinstance(trainer.algorithm, RecordingAlgorithm)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    trainer.fit()
    updates = recording.updates
    assert [u["step"] for u in updates] == [0, 1, 2]
    assert [u["groups"] for u in updates] == [[0, 0, 1, 1], [2, 2, 3, 3], [4, 4, 5, 5]], "the prompt stream"
    assert all(u["keep"] == [True] * 4 for u in updates)
    rows = step_records(run)
    for u, row in zip(updates, rows, strict=True):
        assert row["reward/mean"] == pytest.approx(float(u["rewards"].mean())), "the source's scores"
    assert recording.rollout_entries == 3 * 2, "every chunk of every step made with the rollout weights"
    trained = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    assert all(torch.equal(before[k], trained[k]) for k in trained), "no gradient, no change"


def test_an_algorithm_trains_one_kind_of_experience_and_the_policy_must_make_it(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kind is decided once: media for a generator under NFT; an algorithm that names no kind
    of experience is refused at the start with the kinds there are."""
    from omni_diffusion_rl.config import ConfigError
    from omni_diffusion_rl.trainers.evaluator import HeldOut
    from omni_diffusion_rl.trainers.experience_kinds import KIND_NAMES, MediaExperience

    trainer = Trainer(load_config(None, fast_overrides(model_dir, tmp_path / "run", 1)))
    assert isinstance(trainer.kind, MediaExperience) and type(trainer.heldout) is HeldOut
    assert trainer.kind.cost_length(trainer, [], 1, 4) is None, "a generator's cost unit: the sampling step"

    class VideoOnly(DiffusionNFT):
        experience_kind = "video"

    monkeypatch.setitem(algorithms._factories, "video_only", VideoOnly)  # noqa: SLF001
    overrides = [*fast_overrides(model_dir, tmp_path / "other", 1), "algorithm.name=video_only"]
    with pytest.raises(ConfigError, match=f"experience_kind='video'.*one of {', '.join(KIND_NAMES)}"):
        Trainer(load_config(None, overrides))
