"""The one-file DiffusionNFT (examples/nft_in_one_file.py) against `odrl train` on the demo's
recipe: the same losses, rewards and adapters, bit for bit. The framework's NFT step spans about
twenty files; this file is an oracle written apart from them, and any change of what one NFT step
computes (the loss, the advantages, the noise, the soft update, the LoRA) fails here."""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import fields
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file

from omni_diffusion_rl.config import load_config

from .helpers import REPO, odrl_main, step_records

RECIPE = REPO / "recipes" / "configs" / "tiny_t2av_nft.yaml"
STEPS = 3


def reference() -> ModuleType:
    """examples/nft_in_one_file.py as a module (it is a script, outside the package)."""
    path = REPO / "examples" / "nft_in_one_file.py"
    spec = importlib.util.spec_from_file_location("nft_in_one_file", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_the_one_file_recipe_is_the_demos() -> None:
    cfg = load_config(RECIPE)
    recipe = reference().Recipe()
    expected = {
        "seed": cfg.train.seed,
        "steps": cfg.train.steps,
        "prompts_per_step": cfg.data.prompts_per_step,
        "group_size": cfg.data.group_size,
        "sampling_steps": cfg.sampling.num_steps,
        "time_shift": cfg.sampling.time_shift,
        "timestep_fraction": cfg.algorithm.timestep_fraction,
        "beta": cfg.algorithm.beta,
        "adv_clip_max": cfg.algorithm.adv_clip_max,
        "kl_coef": cfg.algorithm.kl_coef,
        "lr": cfg.optim.lr,
        "weight_decay": cfg.optim.weight_decay,
        "grad_clip": cfg.optim.grad_clip,
        "lora_rank": cfg.model.lora_rank,
        "lora_alpha": cfg.model.lora_alpha,
        "lora_targets": tuple(
            cfg.model.lora_targets or ("to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out")
        ),
        "reward_weights": cfg.reward.weights,
    }
    assert {f.name: getattr(recipe, f.name) for f in fields(recipe)} == expected
    assert list(recipe.reward_weights) == list(cfg.reward.weights)  # the weighted sum's order too
    # what the file writes out itself and the recipe could change without it noticing
    assert (cfg.model.family, cfg.model.pretrained, cfg.data.prompts) == (
        "tiny_av",
        "builtin",
        "builtin:tiny_world",
    )
    assert (cfg.algorithm.name, cfg.algorithm.adv_mode, cfg.algorithm.per_group_std) == (
        "nft",
        "continuous",
        False,
    )
    assert (cfg.algorithm.decay_schedule, cfg.algorithm.timestep_choice) == ("linear_to_0_5", "random")
    assert (cfg.sampling.solver, cfg.sampling.cfg_scale, cfg.train.micro_batch_size) == ("euler", 1.0, 0)
    assert not cfg.reward.options and cfg.train.mixed_precision == "fp32"


@pytest.mark.slow
def test_the_one_file_nft_and_odrl_train_agree_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    ref = reference()
    history, layers = ref.train(ref.Recipe(steps=STEPS), log=lambda _: None)
    run = tmp_path / "run"
    code, _, err = odrl_main(
        capsys,
        "train",
        str(RECIPE),
        f"train.steps={STEPS}",
        f"train.output_dir={run}",
        "train.eval_at_start_and_end=false",
        "train.preview_every=0",
        "train.checkpoint_every=0",
        "train.progress=false",
        "tracking.wandb=false",
    )
    assert code == 0, err
    records = step_records(run)
    assert len(records) == len(history) == STEPS
    for step, (mine, framework) in enumerate(zip(history, records, strict=True), start=1):
        for key, value in mine.items():
            assert value == framework[key], (
                f"step {step}: {key} {value!r} here, {framework[key]!r} in odrl train"
            )
    latest = run / "checkpoints" / (run / "checkpoints" / "latest").read_text().strip()
    tensors = load_file(str(latest / "tensors.safetensors"))
    compared = 0
    for path, layer in layers.items():
        for adapter in ("default", "old"):
            for part in ("A", "B"):
                theirs = tensors[f"{adapter}/{path}.lora_{part}.{adapter}.weight"]
                assert torch.equal(layer.adapters[adapter][part].weight, theirs), f"{adapter} {path} {part}"
                compared += 1
    assert compared == len([k for k in tensors if ".lora_" in k]) > 0
    assert (
        float(layers[next(iter(layers))].adapters["default"]["B"].weight.detach().abs().sum()) > 0
    )  # trained
