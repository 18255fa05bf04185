"""Shared test helpers: a tiny random-init built-in model and a fast training config."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from diffusers import SD3Transformer2DModel

from omni_diffusion_rl.models.tiny_av import TinyAVTransformer

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}


def tiny_model_dir(path: Path, seed: int = 0) -> Path:
    """A small random-init tiny_av transformer saved with save_pretrained.

    adaLN-Zero starts its gates at 0, which would block every gradient into the adapted layers;
    a trained model has open gates, so the modulation layers get small random weights here.
    """
    torch.manual_seed(seed)
    model = TinyAVTransformer(dim=32, depth=1, heads=2, mlp_ratio=2)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "modulation" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(path)
    return path


def fast_overrides(model_dir: Path, output_dir: Path, steps: int = 2) -> list[str]:
    return [
        f"model.pretrained={model_dir}",
        f"train.output_dir={output_dir}",
        f"train.steps={steps}",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "data.eval_samples=4",
        "sampling.num_steps=3",
        "sampling.eval_num_steps=3",
        "train.preview_every=0",
        "train.progress=false",
        "model.lora_rank=4",
        "model.lora_alpha=8",
    ]


def odrl(*args: str) -> list[str]:
    return [sys.executable, "-m", "omni_diffusion_rl.cli", *args]


def step_records(run_dir: Path) -> list[dict]:
    """Training records of a run's metrics.jsonl without wall-clock timings."""
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "reward/mean" in row:
            rows.append({k: v for k, v in row.items() if not k.startswith("time/")})
    return rows


def trained_adapter_norm(run_dir: Path) -> float:
    """Norm of the LoRA B matrices in the run's latest checkpoint: 0 at init, > 0 once trained.

    A sturdier sign that training moved the weights than a held-out reward, which a few steps
    can leave unchanged at the 4 digits a summary keeps."""
    from safetensors.torch import load_file

    checkpoints = run_dir / "checkpoints"
    latest = checkpoints / (checkpoints / "latest").read_text().strip()
    tensors = load_file(str(latest / "tensors.safetensors"))
    return sum(float(v.float().norm()) for k, v in tensors.items() if ".lora_B." in k)


def last_json_line(text: str) -> dict:
    return json.loads([line for line in text.splitlines() if line.startswith("{")][-1])


def tiny_sd3() -> SD3Transformer2DModel:
    """A random-init SD3 transformer small enough for CPU tests (latent [4, 8, 8])."""
    torch.manual_seed(0)
    return SD3Transformer2DModel(
        sample_size=8,
        patch_size=2,
        in_channels=4,
        num_layers=2,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=16,
        caption_projection_dim=16,
        pooled_projection_dim=12,
        out_channels=4,
        pos_embed_max_size=8,
    )


def with_a_spawned_peer(peer: Callable[..., None], args: tuple[Any, ...], here: Callable[[], None]) -> None:
    """Run `here` in this process while `peer(0, *args)` runs in a spawned one (process 1 of a pair),
    then wait for the peer: its failure raises with its traceback."""
    process = mp.start_processes(peer, args=args, nprocs=1, start_method="spawn", join=False)
    try:
        here()
    finally:
        while not process.join():
            pass


def odrl_main(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """`odrl ARGV` through cli.main in this process: its exit code, stdout and stderr (what was
    printed before it is dropped). `capsys`: the test's pytest.CaptureFixture."""
    from omni_diffusion_rl.cli import main

    capsys.readouterr()
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def shifted_wave(wave: torch.Tensor, samples: int) -> torch.Tensor:
    """The waveform delayed by `samples` along its last axis (advanced when negative), silence
    filling in."""
    out = torch.zeros_like(wave)
    if samples > 0:
        out[..., samples:] = wave[..., :-samples]
    elif samples < 0:
        out[..., :samples] = wave[..., -samples:]
    else:
        out = wave.clone()
    return out


def lopsided_bounce(contact: int, fps: float = 24.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A disc falling 6 frames from 14 px onto the floor at frame `contact` and rising 6 frames to
    4 px only (it comes down faster than it goes up, as generated bounces often do), 40 x 60 at
    `fps`, a noise burst at the contact, 44.1 kHz."""
    radius, rate = 8.0, 44_100
    t = torch.arange(36, dtype=torch.float64)
    fall = 14 * (1 - ((t - contact + 6) / 6) ** 2)
    rise = 4 * (1 - ((t - contact - 6) / 6) ** 2)
    lift = torch.where(t <= contact, fall, rise).clamp(min=0)
    lift = torch.where(t < contact - 6, 14.0, torch.where(t > contact + 6, 4.0, lift))
    rows, cols = torch.arange(40, dtype=torch.float64)[:, None], torch.arange(60, dtype=torch.float64)[None]
    frames = torch.zeros(len(t), 3, 40, 60)
    for i, up in enumerate(lift.tolist()):
        disc = (radius + 0.5 - ((rows - (40 - radius - up)) ** 2 + (cols - 30) ** 2).sqrt()).clamp(0, 1)
        frames[i] = disc.float()
    seconds = torch.arange(round(len(t) / fps * rate), dtype=torch.float64) / rate
    start = contact / fps
    burst = torch.where(seconds >= start, torch.exp(-(seconds - start) / 0.03), 0.0)
    noise = torch.randn(len(seconds), generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return frames, (0.3 * burst * noise).float()
