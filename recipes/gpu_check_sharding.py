"""The sharding check for a machine with 2 or more CUDA GPUs (CI has none; run it by hand).

    python recipes/gpu_check_sharding.py --output runs/gpu_check_sharding

On 2 GPUs (nccl), for the tiny built-in model and a tiny random-init MiniMax-H3, 3 steps each:
unsharded against train.sharding=fsdp in fp32 (losses, rewards and adapters within 1e-4: GPU kernels
are not bit-stable across layouts), bf16 against fp32 sharded (losses within 2%), and the most GPU
memory any process allocated (torch.cuda.max_memory_allocated, logged by the trainer as
memory/max_allocated_gib). Prints a table, writes results.json, exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

TOLERANCE = 1e-4
TINY = [
    "recipes/configs/tiny_t2av_nft.yaml",
    "train.steps=3",
    "data.prompts_per_step=4",
    "data.group_size=4",
    "sampling.num_steps=6",
    "train.eval_at_start_and_end=false",
    "train.preview_every=0",
    "train.checkpoint_every=0",
    "train.progress=false",
    "tracking.wandb=false",
]


def h3_overrides(folder: Path) -> list[str]:
    """A tiny random-init MiniMax-H3 (no download) with a brightness-and-loudness reward."""
    from omni_diffusion_rl.benchmarks.tiny_families import (
        AV_LEVEL_NAME,
        H3_CLIP,
        save_tiny_h3,
        write_av_level_plugin,
    )

    save_tiny_h3(folder / "h3")
    options = "{" + ", ".join(f"{k}: {v}" for k, v in H3_CLIP.items()) + "}"
    return [
        "model.family=minimax_h3",
        f"model.pretrained={folder / 'h3'}",
        f"model.options={options}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "optim.lr=3e-4",
        "train.steps=3",
        "train.eval_at_start_and_end=false",
        "train.preview_every=0",
        "train.checkpoint_every=0",
        "train.progress=false",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "sampling.num_steps=3",
        f"reward.plugins=[{write_av_level_plugin(folder)}]",
        f"reward.weights={{{AV_LEVEL_NAME}: 1}}",
        "eval.metrics=[]",
    ]


def train(name: str, overrides: list[str], out: Path) -> Path:
    """`odrl train --nproc 2` on the GPUs; the run's folder."""
    run = out / name
    command = [sys.executable, "-m", "omni_diffusion_rl.cli", "train", "--nproc", "2", *overrides]
    command += [f"train.output_dir={run}", "train.overwrite=true"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline", "ACCELERATE_USE_CPU": "false"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-4000:]}")
    return run


def records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss/total" in r]


def largest_gap(a: Path, b: Path) -> float:
    """The largest difference between two runs' losses, rewards and final adapters."""
    gap = 0.0
    for x, y in zip(records(a), records(b), strict=True):
        for key in x:
            if key.startswith(("loss/", "reward/")):
                gap = max(gap, abs(x[key] - y[key]))
    ta = load_file(
        a / "checkpoints" / (a / "checkpoints" / "latest").read_text().strip() / "tensors.safetensors"
    )
    tb = load_file(
        b / "checkpoints" / (b / "checkpoints" / "latest").read_text().strip() / "tensors.safetensors"
    )
    return max(gap, *(float((ta[k] - tb[k]).abs().max()) for k in ta))


def peak_gib(run: Path) -> float:
    return max(r.get("memory/max_allocated_gib", float("nan")) for r in records(run))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("runs/gpu_check_sharding"))
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        print(f"needs 2 CUDA GPUs; this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    sharded = ["train.sharding=fsdp"]
    runs = {
        "tiny_whole": train("tiny_whole", TINY, out),
        "tiny_sharded": train("tiny_sharded", [*TINY, *sharded], out),
        "tiny_sharded_bf16": train("tiny_sharded_bf16", [*TINY, *sharded, "train.mixed_precision=bf16"], out),
    }
    h3 = h3_overrides(out)
    runs["h3_whole"] = train("h3_whole", h3, out)
    runs["h3_sharded"] = train("h3_sharded", [*h3, *sharded], out)
    runs["h3_sharded_bf16"] = train("h3_sharded_bf16", [*h3, *sharded, "train.mixed_precision=bf16"], out)
    checks = {}
    for family in ("tiny", "h3"):
        checks[f"{family}: sharded = whole (fp32, <= {TOLERANCE})"] = (
            largest_gap(runs[f"{family}_whole"], runs[f"{family}_sharded"]) <= TOLERANCE
        )
        pairs = zip(records(runs[f"{family}_sharded"]), records(runs[f"{family}_sharded_bf16"]), strict=True)
        checks[f"{family}: bf16 losses within 2% of fp32"] = all(
            abs(low["loss/total"] - full["loss/total"]) <= 0.02 * abs(full["loss/total"])
            for full, low in pairs
        )
    print("| run | max GPU memory per process (GiB) |\n| --- | --- |")
    for name, run in runs.items():
        print(f"| {name} | {peak_gib(run):.3f} |")
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    memory = {name: peak_gib(run) for name, run in runs.items()}
    (out / "results.json").write_text(json.dumps({"checks": checks, "max_allocated_gib": memory}, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
