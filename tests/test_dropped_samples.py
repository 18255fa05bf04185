"""Samples a reward cannot score are dropped with a counted reason; scoring overlaps generation."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.reward import RewardError
from omni_diffusion_rl.trainers.accounting import trainable_samples
from omni_diffusion_rl.trainers.trainer import Trainer
from omni_diffusion_rl.world import tiny_world as world

from . import plugin_rewards  # noqa: F401 - registers test_fails_on_red
from .helpers import fast_overrides, step_records, tiny_model_dir

RED = next(s.prompt for s in world.ALL_SCENES if s.color == "red")
BLUE = next(s.prompt for s in world.ALL_SCENES if s.color == "blue")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def test_trainable_samples_need_a_scored_partner_in_their_group() -> None:
    ok = torch.tensor([True, True, True, False, False, False, True, True, True])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3, 3])
    assert trainable_samples(ok, groups).tolist() == [
        True,
        True,
        False,
        False,
        False,
        False,
        True,
        True,
        True,
    ]


def test_unscorable_samples_are_dropped_counted_and_logged(model_dir: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{RED}\n{BLUE}\n")
    run = tmp_path / "run"
    overrides = fast_overrides(model_dir, run, 2) + [
        f"data.prompts={prompts}",
        "reward.weights={color_match: 1.0, test_fails_on_red: 1.0}",
        "reward.max_failed_fraction=0.5",
        "train.eval_at_start_and_end=false",
    ]
    summary = Trainer(load_config(None, overrides)).fit()
    counts = summary["samples"]
    assert counts == {"generated": 8, "trained": 4, "dropped/reward_failed": 4, "dropped/group_too_small": 0}
    records = [json.loads(line) for line in (run / "failed_samples.jsonl").read_text().splitlines()]
    assert len(records) == 4 and {r["prompt"] for r in records} == {RED}
    assert all("test_fails_on_red: ValueError: no opinion on red things" in r["reason"] for r in records)
    last = step_records(run)[-1]
    assert last["samples/generated"] == last["samples/trained"] + last["samples/dropped/reward_failed"]
    assert torch.isfinite(torch.tensor(last["reward/mean"])) and last["reward/test_fails_on_red"] == 1.0

    only_red = tmp_path / "red.txt"
    only_red.write_text(f"{RED}\n")
    overrides[overrides.index(f"data.prompts={prompts}")] = f"data.prompts={only_red}"
    with pytest.raises(RewardError, match="4 of 4 samples could not be scored"):
        Trainer(load_config(None, [*overrides, f"train.output_dir={tmp_path / 'red'}"])).fit()


def test_scoring_while_the_next_chunk_generates_trains_the_same(model_dir: Path, tmp_path: Path) -> None:
    runs = {}
    for chunks in (1, 2):
        run = tmp_path / f"chunks{chunks}"
        overrides = fast_overrides(model_dir, run, 2) + [
            "train.eval_at_start_and_end=false",
            f"sampling.rollout_chunks={chunks}",
        ]
        Trainer(load_config(None, overrides)).fit()
        runs[chunks] = step_records(run)
    for a, b in zip(runs[1], runs[2], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-5), key


def test_a_step_with_nothing_left_to_train_changes_nothing(model_dir: Path, tmp_path: Path) -> None:
    from omni_diffusion_rl.models import lora

    only_red = tmp_path / "red.txt"
    only_red.write_text(f"{RED}\n")
    overrides = fast_overrides(model_dir, tmp_path / "run", 2) + [
        f"data.prompts={only_red}",
        "reward.weights={color_match: 1.0, test_fails_on_red: 1.0}",
        "reward.max_failed_fraction=1.0",
        "train.eval_at_start_and_end=false",
    ]
    trainer = Trainer(load_config(None, overrides))
    before = {k: v.clone() for k, v in lora.nft_adapter_tensors(trainer.transformer).items()}
    summary = trainer.fit()
    after = lora.nft_adapter_tensors(trainer.transformer)
    assert all(torch.equal(before[k], after[k]) for k in before), "no sample trained: no update"
    assert summary["samples"] == {
        "generated": 8,
        "trained": 0,
        "dropped/reward_failed": 8,
        "dropped/group_too_small": 0,
    }
    assert all(r["step_skipped"] == 1.0 for r in step_records(tmp_path / "run"))


class _AsyncWithLoopState:
    """An async reward that keeps a loop-bound object across calls (like an HTTP session)."""

    def __init__(self) -> None:
        self.lock: asyncio.Lock | None = None
        self.calls = 0

    async def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        if self.lock is None:
            self.lock = asyncio.Lock()
        async with self.lock:  # fails on a second loop: "bound to a different event loop"
            await asyncio.sleep(0)
            self.calls += 1
        return torch.full((len(prompts),), float(self.calls))


def test_async_rewards_keep_their_loop_across_calls() -> None:
    from omni_diffusion_rl.reward import WeightedReward

    reward = _AsyncWithLoopState()
    combined = WeightedReward({"a": reward}, {"a": 1.0}, retries=0)
    media = MediaBatch(audio=torch.zeros(2, 1, 4))
    for call in (1, 2, 3):
        result = combined.submit(media, ["p", "q"]).result() if call == 2 else combined(media, ["p", "q"])
        assert result.failures == {} and result.total.tolist() == [float(call)] * 2
    combined.close()


def test_a_reward_that_fails_on_preview_samples_shows_them_as_failed(model_dir: Path, tmp_path: Path) -> None:
    """A plug-in giving NaN for red held-out prompts: previews and eval mark those samples failed (with
    the reason) and the run goes on."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{RED}\n{BLUE}\n")
    overrides = fast_overrides(model_dir, tmp_path / "run", steps=1)
    overrides += [
        f"data.eval_prompts={prompts}",
        "train.preview_every=1",
        "reward.weights={color_match: 1.0, test_nan_on_red: 1.0}",
        "reward.max_failed_fraction=1.0",
    ]
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    index = json.loads((tmp_path / "run" / "previews" / "step_00001" / "index.json").read_text())
    failed = [s for s in index["samples"] if "failed" in s]
    assert failed and all(RED in s["prompt"] for s in failed)
    assert all("test_nan_on_red: non-finite score" in s["failed"] for s in failed)
    assert all(s["rewards"]["reward"] is None for s in failed)
    assert all(s["rewards"]["reward"] is not None for s in index["samples"] if "failed" not in s)
    assert (tmp_path / "run" / "previews" / "step_00001" / "sheet.png").is_file()
