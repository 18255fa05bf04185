"""The second algorithm, RAFT (reward-ranked flow-matching fine-tuning), on the shared trainer: it
proves the algorithm seam and serves as a baseline next to DiffusionNFT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.trainers.raft import RewardRankedFineTuning, best_of_each_group
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, last_json_line, step_records, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def test_best_of_each_group_ranks_within_groups_among_trainable_samples() -> None:
    rewards = torch.tensor([0.1, 0.9, 0.5, 0.7, 0.2, 0.3, 0.8, 0.4])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    keep = torch.tensor([True, False, True, True, True, True, True, True])  # 0.9 could not be trained
    assert best_of_each_group(rewards, groups, keep, 1).nonzero().flatten().tolist() == [3, 6]
    assert best_of_each_group(rewards, groups, keep, 2).nonzero().flatten().tolist() == [2, 3, 6, 7]


def test_raft_trains_the_best_samples_and_rollout_follows_the_trained_adapter(
    model_dir: Path, tmp_path: Path
) -> None:
    cfg = load_config(None, [*fast_overrides(model_dir, tmp_path / "run", 3), "algorithm.name=raft"])
    trainer = Trainer(cfg)
    assert isinstance(trainer.algorithm, RewardRankedFineTuning)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    trainer.fit()
    rows = step_records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["raft/trained_samples"] == 2 for r in rows)  # 2 groups of 2, the best of each
    assert all(r["loss/flow_matching"] > 0 and r["loss/flow_matching"] == r["loss/total"] for r in rows)
    trained = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    old = lora.adapter_state_dict(trainer.transformer, lora.OLD)
    assert any(not torch.equal(before[k], trained[k]) for k in trained), "the trained adapter moved"
    same = [torch.equal(v, old[k.replace(f".{lora.TRAINED}.", f".{lora.OLD}.")]) for k, v in trained.items()]
    assert all(same), "the rollout weights are the trained adapter"


def test_an_unknown_algorithm_and_a_keep_of_the_whole_group_are_refused(
    model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(
        ConfigError,
        match="algorithm.name: unknown algorithm 'nope'; registered: awm, distill, flow_grpo, gspo, nft, "
        "raft",
    ):
        load_config(None, [*fast_overrides(model_dir, tmp_path / "a"), "algorithm.name=nope"])
    with pytest.raises(ConfigError, match="algorithm.raft_keep=2 keeps every sample"):
        load_config(None, ["algorithm.name=raft", "algorithm.raft_keep=2", "data.group_size=2"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["separate", "hybrid"])
def test_raft_runs_in_the_async_modes_with_two_processes(model_dir: Path, tmp_path: Path, mode: str) -> None:
    from .test_separate import _launch

    run = tmp_path / "run"
    args = [*fast_overrides(model_dir, run, 3), "algorithm.name=raft", f"execution.mode={mode}"]
    proc = _launch([*args, "execution.data_timeout_s=60"], 29631 if mode == "separate" else 29632)
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = last_json_line(proc.stdout)
    buf = summary["execution"]["buffer"]
    assert buf["trained"] == 3 * 2 * 2 == summary["samples"]["trained"]
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and all("loss/flow_matching" in r for r in rows)
