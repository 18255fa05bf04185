"""The CLI's sample and pretrain paths, and the tiny world's pre-training."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import torch

from omni_diffusion_rl.models.tiny_av import TinyAVPolicy
from omni_diffusion_rl.world import tiny_world as world
from omni_diffusion_rl.world.pretrain import pretrain_base_model

from .helpers import ENV, REPO, odrl, tiny_model_dir


def test_pretrain_writes_a_loadable_model_and_lowers_the_loss(tmp_path: Path) -> None:
    out = tmp_path / "base"
    first = pretrain_base_model(out, steps=1, batch_size=8, dataset_size=32, progress=False)
    assert (out / "config.json").is_file()
    later = pretrain_base_model(out, steps=40, batch_size=16, dataset_size=64, lr=3e-3, progress=False)
    assert later["final_loss"] < first["final_loss"]
    policy = TinyAVPolicy.from_pretrained(out)
    v = policy.velocity(
        torch.zeros(2, world.LATENT_DIM), torch.full((2,), 0.5), policy.encode_prompts(["a", "b"])
    )
    assert v.shape == (2, world.LATENT_DIM) and torch.isfinite(v).all()


def test_missing_model_directory_is_a_clear_error(tmp_path: Path) -> None:
    try:
        TinyAVPolicy.from_pretrained(tmp_path / "absent")
    except FileNotFoundError as e:
        assert "config.json missing" in str(e)
    else:
        raise AssertionError("loading a missing model must fail")


def test_sample_command_writes_previews(tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path / "model")
    out = tmp_path / "samples"
    proc = subprocess.run(
        odrl(
            "sample",
            "--pretrained",
            str(model),
            "--prompt",
            world.HELDOUT_PROMPTS[0],
            "--prompt",
            world.HELDOUT_PROMPTS[1],
            "--steps",
            "3",
            "--output",
            str(out),
        ),
        cwd=REPO,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    files = json.loads(proc.stdout.strip().splitlines()[-1])["files"]
    assert {"sheet.png", "sample_00.gif", "sample_01.wav", "index.json"} <= set(files)
    index = json.loads((out / "index.json").read_text())
    assert index["prompts"] == world.HELDOUT_PROMPTS[:2]


def test_every_tiny_world_prompt_parses_back_to_its_scene() -> None:
    for scene in world.ALL_SCENES:
        assert world.parse_prompt(scene.prompt) == scene
    assert world.parse_prompt("a photo of a cat") is None
    assert not set(world.TRAIN_PROMPTS) & set(world.HELDOUT_PROMPTS)
