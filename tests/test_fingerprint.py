"""Which checkpoints fit which model: runtime knobs may change between a run and its resume, the
identity may not, checkpoints from before the rule still resume, and sampling refuses a checkpoint
whose base model changed under its path."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import ModelConfig, load_config
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.models.fingerprint import _hash, fingerprint_matches, model_fingerprint
from omni_diffusion_rl.models.tiny_av import TinyAVTransformer
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")


def test_runtime_knobs_may_change_and_the_identity_may_not() -> None:
    torch.manual_seed(0)
    transformer = TinyAVTransformer(dim=16, depth=1, heads=2, mlp_ratio=2)
    current = dataclasses.asdict(ModelConfig(options={"height": 32}))
    state = {"model_fingerprint": model_fingerprint(current, transformer), "config": {"model": current}}
    knobs = {**current, "gradient_checkpointing": True, "options": {"height": 32, "vae_tiling": False}}
    assert fingerprint_matches(state, knobs, transformer)
    for change in ({"lora_rank": 8}, {"base_dtype": "bf16"}, {"options": {"height": 64}}):
        assert not fingerprint_matches(state, {**current, **change}, transformer), change
    other = TinyAVTransformer(dim=32, depth=1, heads=2, mlp_ratio=2)
    assert not fingerprint_matches(state, current, other), "another transformer config"


def test_where_the_base_was_loaded_from_is_not_its_identity(tmp_path: Path) -> None:
    """The same base saved in two folders (an install that moved, a diffusers upgrade) fits the same
    checkpoints; a checkpoint hashed with the private entries, as before, still fits its own."""
    torch.manual_seed(0)
    TinyAVTransformer(dim=16, depth=1, heads=2, mlp_ratio=2).save_pretrained(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    here = TinyAVTransformer.from_pretrained(tmp_path / "a")
    there = TinyAVTransformer.from_pretrained(tmp_path / "b")
    assert dict(here.config)["_name_or_path"] != dict(there.config)["_name_or_path"]
    current = dataclasses.asdict(ModelConfig())
    state = {"model_fingerprint": model_fingerprint(current, here), "config": {"model": current}}
    assert fingerprint_matches(state, current, there)
    before = {"model_fingerprint": _hash(current, here), "config": {"model": current}}
    assert fingerprint_matches(before, current, here)


def test_a_checkpoint_from_before_the_rule_still_fits() -> None:
    """Before: the whole model config was hashed, and base_dtype did not exist yet."""
    transformer = TinyAVTransformer(dim=16, depth=1, heads=2, mlp_ratio=2)
    current = dataclasses.asdict(ModelConfig())
    old = {k: v for k, v in current.items() if k != "base_dtype"}
    state = {"model_fingerprint": _hash(old, transformer), "config": {"model": old}}
    assert fingerprint_matches(state, current, transformer)
    assert not fingerprint_matches(state, {**current, "lora_rank": 3}, transformer)
    forged = {"model_fingerprint": _hash(old, transformer), "config": {"model": {**old, "lora_rank": 3}}}
    assert not fingerprint_matches(forged, {**current, "lora_rank": 3}, transformer)


def test_resume_with_checkpointing_switched_on_and_sampling_refuses_a_changed_base(tmp_path: Path) -> None:
    model = tiny_model_dir(tmp_path / "model")
    run = tmp_path / "run"
    Trainer(load_config(None, [*fast_overrides(model, run, 1), "train.eval_at_start_and_end=false"])).fit()
    overrides = [*fast_overrides(model, run, 2), "train.eval_at_start_and_end=false"]
    resumed = Trainer(load_config(None, [*overrides, "model.gradient_checkpointing=true"]))
    resumed.fit(resume=str(run / "checkpoints"))
    assert resumed.step == 2
    latest = run / "checkpoints" / "step_0000002"
    for name in ("training_state.json", "training_state.safetensors"):
        (latest / name).unlink()  # sampling reads the adapters only, never the optimizer or RNG state
    assert load_policy(latest) is not None
    shutil.rmtree(model)
    torch.manual_seed(1)
    TinyAVTransformer(dim=48, depth=1, heads=2, mlp_ratio=2).save_pretrained(model)  # replaced in place
    with pytest.raises(
        CheckpointError, match="trained on another base model than the one at model.pretrained"
    ):
        load_policy(latest)
