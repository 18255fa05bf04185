"""`odrl export`: a checkpoint's trained adapter, loaded back by peft and diffusers' own loaders."""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
from peft import PeftModel
from safetensors import safe_open
from safetensors.torch import load_file

from omni_diffusion_rl.checkpoint import CheckpointError
from omni_diffusion_rl.config import ConfigError, ModelConfig, load_config
from omni_diffusion_rl.export import (
    DIFFUSERS_WEIGHTS,
    EXPORT_HELP,
    PEFT_WEIGHTS,
    ExportError,
    add_export_arguments,
    export_adapter,
    run_export,
)
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.models import build_policy, lora
from omni_diffusion_rl.models.diffusers_adapter import DiffusersImagePolicy
from omni_diffusion_rl.models.policy import FlowPolicy
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, tiny_model_dir, tiny_sd3
from .test_diffusers_adapter import tiny_stable_audio

PROMPTS = ["a red circle moving left", "a low drum beat"]


@rewards.register("test_export_level", overwrite=True)
class MeanLevel:
    """A reward for any modality: the squashed mean of the media (images and audio alike)."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        x = media.video if media.video is not None else media.audio
        return torch.sigmoid(x.flatten(1).mean(dim=1))


pytestmark = pytest.mark.usefixtures("single_thread")


@torch.no_grad()
def _perturb_trained_adapter(transformer: torch.nn.Module, seed: int) -> None:
    """Move the trained adapter well away from the base (and from `old`) so exports can be told apart."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in sorted(lora.adapter_parameters(transformer, lora.TRAINED).items()):
        scale = 0.1 if "lora_B" in name else 0.02
        param.add_(scale * torch.randn(param.shape, generator=gen))


def _checkpoint(overrides: list[str], train: bool, seed: int) -> Path:
    """A real trainer checkpoint: (optionally) one NFT step, then a perturbed trained adapter saved."""
    trainer = Trainer(load_config(None, overrides + ["train.eval_at_start_and_end=false"]))
    if train:
        trainer.fit()
    else:
        trainer.step = 1
    _perturb_trained_adapter(trainer.transformer, seed)
    path = trainer.save()
    assert path is not None
    return path


def _diffusers_overrides(family: str, pipe: Path, run: Path, prompts: Path) -> list[str]:
    return [
        f"model.family={family}",
        f"model.pretrained={pipe}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        f"data.prompts={prompts}",
        f"data.eval_prompts={prompts}",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "sampling.num_steps=2",
        "reward.weights={test_export_level: 1.0}",
        "eval.metrics=[]",
        f"train.output_dir={run}",
        "train.steps=1",
        "train.preview_every=0",
        "train.progress=false",
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def tiny_checkpoint(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("tiny_run")
    _checkpoint(fast_overrides(model_dir, run, steps=1), train=True, seed=1)
    return run / "checkpoints"


@pytest.fixture(scope="module")
def sd3_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(pipeline directory with a tiny random SD3 transformer, checkpoints folder trained on it)."""
    root = tmp_path_factory.mktemp("sd3")
    tiny_sd3().save_pretrained(root / "pipe" / "transformer")
    prompts = root / "prompts.txt"
    prompts.write_text("a bright sky\na dark room\n", encoding="utf-8")
    _checkpoint(_diffusers_overrides("sd3", root / "pipe", root / "run", prompts), train=True, seed=2)
    return root / "pipe", root / "run" / "checkpoints"


def _inputs(policy: FlowPolicy) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    x_t = torch.randn(len(PROMPTS), *policy.latent_shape, generator=gen)
    return x_t, torch.tensor([0.3, 0.8]), policy.encode_prompts(PROMPTS)


@torch.no_grad()
def _velocity(policy: FlowPolicy) -> torch.Tensor:
    return policy.velocity(*_inputs(policy))


@torch.no_grad()
def _toolkit_velocities(checkpoint: Path) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(trained, old, base) velocities of the toolkit's own policy for the checkpoint."""
    policy = load_policy(checkpoint)
    trained = _velocity(policy)
    with lora.using_adapter(policy.transformer, lora.OLD):
        old = _velocity(policy)
    with lora.adapters_disabled(policy.transformer):
        base = _velocity(policy)
    # The exported adapter must be distinguishable from the base and from the `old` adapter.
    assert (trained - base).abs().max() > 1e-3
    assert (trained - old).abs().max() > 1e-3
    return trained, old, base


def _no_temporaries(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".tmp-" in p.name]


# -------------------------------------------------------------------------------- built-in model


def test_peft_export_of_the_tiny_model_loads_with_peft(
    tiny_checkpoint: Path, model_dir: Path, tmp_path: Path
) -> None:
    out = export_adapter(tiny_checkpoint, tmp_path / "export", "peft")
    assert out == tmp_path / "export"
    assert sorted(p.name for p in out.iterdir()) == [
        "adapter_config.json",
        PEFT_WEIGHTS,
        "odrl_export.json",
    ]
    _no_temporaries(tmp_path)
    provenance = json.loads((out / "odrl_export.json").read_text(encoding="utf-8"))
    assert provenance["step"] == 1 and provenance["family"] == "tiny_av" and provenance["format"] == "peft"
    trained, _, _ = _toolkit_velocities(tiny_checkpoint)

    fresh, _ = build_policy(ModelConfig(pretrained=str(model_dir)))
    base = _velocity(fresh)
    peft_model = PeftModel.from_pretrained(fresh.transformer, str(out))
    assert peft_model.get_base_model() is fresh.transformer  # peft adapted the network in place
    assert peft_model.active_adapter == "default"
    assert (base - trained).abs().max() > 1e-3
    torch.testing.assert_close(_velocity(fresh), trained)
    # Through the PeftModel's own forward as well.
    x_t, t, cond = _inputs(fresh)
    with torch.no_grad():
        direct = peft_model(x_t, t, cond["text_ids"], cond["text_mask"])
    torch.testing.assert_close(direct, trained)

    # Saving the loaded PeftModel again writes exactly what we wrote.
    peft_model.save_pretrained(str(tmp_path / "resaved"))
    ours, theirs = load_file(str(out / PEFT_WEIGHTS)), load_file(str(tmp_path / "resaved" / PEFT_WEIGHTS))
    assert sorted(ours) == sorted(theirs) and all(k.startswith("base_model.model.") for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    config = json.loads((out / "adapter_config.json").read_text(encoding="utf-8"))
    resaved = json.loads((tmp_path / "resaved" / "adapter_config.json").read_text(encoding="utf-8"))
    assert config == resaved
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["inference_mode"] is True


def test_export_never_unpickles_objects_pt(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """objects.pt is replaced by bytes no unpickler accepts (manifest updated): the export still works."""
    step = tmp_path / "step_0000001"
    shutil.copytree(tiny_checkpoint / "step_0000001", step)
    objects = step / "objects.pt"
    objects.write_bytes(b"this is not a pickle")
    manifest = json.loads((step / "manifest.json").read_text(encoding="utf-8"))
    manifest["files"]["objects.pt"] = {
        "bytes": objects.stat().st_size,
        "sha256": hashlib.sha256(objects.read_bytes()).hexdigest(),
    }
    (step / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    out = tmp_path / "empty"
    out.mkdir()  # an existing empty directory is filled (replaced atomically)
    assert export_adapter(step, out) == out
    assert (out / PEFT_WEIGHTS).is_file()
    _no_temporaries(tmp_path)


# ---------------------------------------------------------------------------------- diffusers SD3


@torch.no_grad()
def _sd3_velocity(transformer: torch.nn.Module) -> torch.Tensor:
    return _velocity(DiffusersImagePolicy(transformer))


def test_diffusers_export_of_sd3_loads_with_diffusers(
    sd3_checkpoint: tuple[Path, Path], tmp_path: Path
) -> None:
    pipe_dir, checkpoint = sd3_checkpoint
    out = export_adapter(checkpoint, tmp_path / "lora", "diffusers")
    assert sorted(p.name for p in out.iterdir()) == ["odrl_export.json", DIFFUSERS_WEIGHTS]
    with safe_open(str(out / DIFFUSERS_WEIGHTS), framework="pt") as f:
        keys, metadata = list(f.keys()), f.metadata()
    assert keys and all(k.startswith("transformer.") and ".default." not in k for k in keys)
    lora_config = json.loads(metadata["lora_adapter_metadata"])
    assert lora_config["transformer.r"] == 4 and lora_config["transformer.lora_alpha"] == 8
    trained, _, base = _toolkit_velocities(checkpoint)

    transformer = SD3Transformer2DModel.from_pretrained(pipe_dir / "transformer")
    torch.testing.assert_close(_sd3_velocity(transformer), base)
    transformer.load_lora_adapter(str(out), weight_name=DIFFUSERS_WEIGHTS)
    torch.testing.assert_close(_sd3_velocity(transformer), trained)

    pipeline = StableDiffusion3Pipeline(
        transformer=SD3Transformer2DModel.from_pretrained(pipe_dir / "transformer"),
        scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=None,
        text_encoder=None,
        tokenizer=None,
        text_encoder_2=None,
        tokenizer_2=None,
        text_encoder_3=None,
        tokenizer_3=None,
    )
    pipeline.load_lora_weights(str(out))
    torch.testing.assert_close(_sd3_velocity(pipeline.transformer), trained)


def test_peft_export_of_sd3_loads_with_peft(sd3_checkpoint: tuple[Path, Path], tmp_path: Path) -> None:
    pipe_dir, checkpoint = sd3_checkpoint
    out = export_adapter(checkpoint, tmp_path / "peft", "peft")
    trained, _, _ = _toolkit_velocities(checkpoint)
    transformer = SD3Transformer2DModel.from_pretrained(pipe_dir / "transformer")
    PeftModel.from_pretrained(transformer, str(out))
    torch.testing.assert_close(_sd3_velocity(transformer), trained)


def test_stable_audio_exports_peft_and_refuses_diffusers(tmp_path: Path) -> None:
    tiny_stable_audio().save_pretrained(tmp_path / "pipe" / "transformer")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a low drum beat\n", encoding="utf-8")
    overrides = _diffusers_overrides("stable_audio", tmp_path / "pipe", tmp_path / "run", prompts)
    checkpoint = _checkpoint(overrides, train=False, seed=3)
    with pytest.raises(ExportError, match="no LoRA loader for Stable Audio.*--format peft"):
        export_adapter(checkpoint, tmp_path / "lora", "diffusers")
    assert not (tmp_path / "lora").exists()
    out = export_adapter(checkpoint, tmp_path / "peft", "peft")
    trained, _, _ = _toolkit_velocities(checkpoint)
    fresh, _ = build_policy(ModelConfig(family="stable_audio", pretrained=str(tmp_path / "pipe")))
    PeftModel.from_pretrained(fresh.transformer, str(out))
    torch.testing.assert_close(_velocity(fresh), trained)


# --------------------------------------------------------------------------------------- refusals


def test_diffusers_format_is_refused_for_the_builtin_model(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="tiny_av.*not a diffusers model.*use --format peft"):
        export_adapter(tiny_checkpoint, tmp_path / "out", "diffusers")
    assert not (tmp_path / "out").exists()
    _no_temporaries(tmp_path)


def test_unknown_format_lists_the_valid_ones(tiny_checkpoint: Path, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="unknown export format 'onnx'; choose one of: peft, diffusers"):
        export_adapter(tiny_checkpoint, tmp_path / "out", "onnx")
    assert issubclass(ExportError, ConfigError)  # `odrl` reports it as a usage error
    assert not (tmp_path / "out").exists()


def test_occupied_output_is_never_overwritten(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine", encoding="utf-8")
    with pytest.raises(ExportError, match="not empty; refusing to overwrite"):
        export_adapter(tiny_checkpoint, out)
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text(encoding="utf-8") == "mine"
    a_file = tmp_path / "adapter"
    a_file.write_text("x", encoding="utf-8")
    with pytest.raises(ExportError, match="not a directory"):
        export_adapter(tiny_checkpoint, a_file)
    _no_temporaries(tmp_path)


def test_a_path_that_is_not_a_checkpoint_is_refused(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "tensors.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        export_adapter(plain, tmp_path / "out")
    with pytest.raises(CheckpointError, match="does not exist"):
        export_adapter(tmp_path / "nowhere", tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------ command line


def test_command_line_functions(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    parser = argparse.ArgumentParser(prog="odrl")
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help=EXPORT_HELP)
    add_export_arguments(export)
    export.set_defaults(func=run_export)
    args = parser.parse_args(["export", str(tiny_checkpoint), str(tmp_path / "out"), "--format", "peft"])
    assert args.func(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(printed.strip().splitlines()[-1])
    assert result["output"] == str(tmp_path / "out") and result["format"] == "peft"
    assert "PeftModel.from_pretrained" in printed
    assert (tmp_path / "out" / PEFT_WEIGHTS).is_file()
    with pytest.raises(SystemExit):
        parser.parse_args(["export", str(tiny_checkpoint), str(tmp_path / "x"), "--format", "onnx"])
