"""The trainer runs a real diffusers transformer (tiny SD3, random init) with a user's reward."""

from __future__ import annotations

import json
import math
from pathlib import Path

from omni_diffusion_rl.config import load_config
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import step_records, tiny_sd3, trained_adapter_norm


@rewards.register("test_brightness", overwrite=True)
class Brightness:
    """Mean pixel value: a user-defined reward registered by decorator."""

    def score(self, media, prompts):  # noqa: ANN001, ANN202
        return media.video.mean(dim=(1, 2, 3, 4))


def test_nft_on_a_tiny_sd3_transformer(tmp_path: Path) -> None:
    tiny_sd3().save_pretrained(tmp_path / "pipe" / "transformer")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a bright sky\na dark room\n", encoding="utf-8")
    run = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "model.family=sd3",
            f"model.pretrained={tmp_path / 'pipe'}",
            "model.lora_rank=4",
            "model.lora_alpha=8",
            f"data.prompts={prompts}",
            f"data.eval_prompts={prompts}",
            "data.prompts_per_step=2",
            "data.group_size=2",
            "data.eval_samples=2",
            "sampling.num_steps=3",
            "sampling.eval_num_steps=3",
            "reward.weights={test_brightness: 1.0}",
            "eval.metrics=[]",  # the tiny world's judge does not apply to an image model
            f"train.output_dir={run}",
            "train.steps=2",
            "train.preview_every=1",
            "train.progress=false",
        ],
    )
    summary = Trainer(cfg).fit()
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert all(math.isfinite(row[k]) for k in row if k.startswith("loss/")), row
        assert row["grad_norm"] > 0, f"step {row['step']}: no gradient reached the adapters"
    # the KL to the base model is 0 while the adapter is at its init, and not once step 1 moved it
    assert rows[0]["loss/kl"] == 0 and rows[1]["loss/kl"] > 0, "step 1 left the adapter where it started"
    assert trained_adapter_norm(run) > 0, "lora_B is 0 at init: the optimizer never stepped"
    assert math.isfinite(summary["heldout_reward_after"])
    index = json.loads((run / "previews" / "step_00001" / "index.json").read_text())
    assert index["prompts"] == ["a bright sky"] * 2 + ["a dark room"] * 2  # two samples a prompt
    assert index["reference"] is False  # the world's renders are for the tiny world only
    policy = load_policy(run / "checkpoints")
    assert policy.latent_shape == (4, 8, 8)
