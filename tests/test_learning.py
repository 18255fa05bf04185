"""A short DiffusionNFT run on the shipped base model raises the reward it is trained on, and the
judge that it does not train on agrees."""

from __future__ import annotations

from pathlib import Path

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.trainers.trainer import Trainer


def test_short_run_raises_reward_on_its_prompts(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(
        "a red circle with a high tone at the start\na blue square with a low tone at the end\n"
    )
    cfg = load_config(
        None,
        [
            f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}",
            f"train.output_dir={tmp_path / 'run'}",
            "data.prompts_per_step=2",
            "data.group_size=8",
            "data.eval_samples=16",
            "sampling.num_steps=6",
            "sampling.eval_num_steps=6",
            "algorithm.timestep_fraction=0.5",
            "optim.lr=2e-3",
            "train.steps=8",
            "train.preview_every=0",
            "train.checkpoint_every=0",
            "train.progress=false",
            "reward.weights={color_match: 1.0}",
        ],
    )
    summary = Trainer(cfg).fit()
    assert summary["heldout_reward_after"] > summary["heldout_reward_before"] + 0.1, summary
    before, after = summary["heldout_tiny_world_judge_before"], summary["heldout_tiny_world_judge_after"]
    assert after["color"] > before["color"], summary
