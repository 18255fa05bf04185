"""Mixed precision and gradient checkpointing on the tiny model: bf16 autocast keeps the loss
within 2% of fp32 with the trained weights and optimizer in fp32; checkpointing recomputes the
blocks and leaves the step unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.precision import resolve_mixed_precision
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, step_records, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def _run(model_dir: Path, run: Path, steps: int, *extra: str) -> Trainer:
    overrides = [*fast_overrides(model_dir, run, steps), "train.eval_at_start_and_end=false", *extra]
    trainer = Trainer(load_config(None, overrides))
    trainer.fit()
    return trainer


@pytest.mark.slow
def test_bf16_keeps_the_loss_within_2_percent_of_fp32_over_5_steps(model_dir: Path, tmp_path: Path) -> None:
    _run(model_dir, tmp_path / "fp32", 5)
    bf16 = _run(model_dir, tmp_path / "bf16", 5, "train.mixed_precision=bf16")
    full = [r["loss/total"] for r in step_records(tmp_path / "fp32")]
    half = [r["loss/total"] for r in step_records(tmp_path / "bf16")]
    assert len(full) == len(half) == 5 and all(torch.isfinite(torch.tensor(half)))
    relative = [abs(h - f) / abs(f) for f, h in zip(full, half, strict=True)]
    assert max(relative) < 0.02, relative
    assert max(relative) > 0, "the bf16 run computed in bf16 (its losses differ from fp32's)"
    assert all(p.dtype == torch.float32 for p in bf16.params), "trained weights stay fp32"
    states = [s for s in bf16.optimizer.state.values() if "exp_avg" in s]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states), "optimizer state stays fp32"


def test_accelerate_launch_mixed_precision_is_followed_and_fp16_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert resolve_mixed_precision("fp32") == "fp32"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    assert resolve_mixed_precision("fp32") == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    assert resolve_mixed_precision("fp32") == "fp32" and resolve_mixed_precision("bf16") == "bf16"
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    with pytest.raises(ValueError, match="only bf16 is supported"):
        resolve_mixed_precision("fp32")
    with pytest.raises(ConfigError, match="train.mixed_precision"):
        load_config(None, ["train.mixed_precision=fp16"])


def test_gradient_checkpointing_recomputes_the_blocks_and_leaves_the_step_unchanged(
    model_dir: Path, tmp_path: Path
) -> None:
    plain = _run(model_dir, tmp_path / "plain", 2)
    overrides = [
        *fast_overrides(model_dir, tmp_path / "ckpt", 2),
        "train.eval_at_start_and_end=false",
        "model.gradient_checkpointing=true",
    ]
    trainer = Trainer(load_config(None, overrides))
    assert trainer.transformer.gradient_checkpointing
    calls = []
    recompute = trainer.transformer._gradient_checkpointing_func  # noqa: SLF001

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return recompute(*args, **kwargs)

    trainer.transformer._gradient_checkpointing_func = counting  # noqa: SLF001
    trainer.fit()
    assert calls, "the blocks ran through the checkpointing function"
    rows = [step_records(tmp_path / name) for name in ("plain", "ckpt")]
    for a, b in zip(*rows, strict=True):
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-5)
    for p, q in zip(plain.params, trainer.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["nft", "raft"])
def test_micro_batches_give_the_same_step_with_smaller_passes(
    model_dir: Path, tmp_path: Path, algorithm: str
) -> None:
    from omni_diffusion_rl.models.tiny_av import TinyAVPolicy

    whole = _run(model_dir, tmp_path / "whole", 2, f"algorithm.name={algorithm}")
    sizes: list[int] = []
    velocity = TinyAVPolicy.velocity

    def counting(self, x_t, t, cond):  # noqa: ANN001, ANN202
        sizes.append(len(x_t))
        return velocity(self, x_t, t, cond)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TinyAVPolicy, "velocity", counting)
        split = _run(
            model_dir, tmp_path / "split", 2, f"algorithm.name={algorithm}", "train.micro_batch_size=1"
        )
    assert max(sizes) > 1 and 1 in sizes, "generation ran whole, training one sample at a time"
    rows = [step_records(tmp_path / name) for name in ("whole", "split")]
    for a, b in zip(*rows, strict=True):
        assert a["loss/total"] == pytest.approx(b["loss/total"], rel=1e-5)
    for p, q in zip(whole.params, split.params, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
