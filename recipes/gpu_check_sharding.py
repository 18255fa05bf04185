"""The GPU check of sharding and of the memory traces (CI has no GPU; run it by hand).

    python recipes/gpu_check_sharding.py --output runs/gpu_check_sharding

On 1 GPU or more:
- memory: each family's traced step (tiny_av at a GPU size; 4 released H3 blocks and 2 released
  LTX-2 blocks at the recipes' samples, 8 fake ranks) against torch.cuda.max_memory_allocated over
  the same step run on the GPU, a micro-step and a forward without gradients: within 10%;
- a tiny random-init MiniMax-H3 sharded in one process, 3 steps each: fp32, a bf16 base
  (model.base_dtype=bf16: losses within 5% of fp32) and train.cpu_offload (losses, rewards and
  adapters within 1e-4 of no offload).
On 2 GPUs or more (nccl), the tiny built-in model and the tiny H3: unsharded against
train.sharding=fsdp in fp32 (within 1e-4: GPU kernels are not bit-stable across layouts), bf16
mixed precision against fp32 sharded (losses within 2%), and the most GPU memory any process
allocated (logged by the trainer as memory/max_allocated_gib). Prints tables, writes results.json,
exits 1 if a check fails.
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


def train(name: str, overrides: list[str], out: Path, processes: int = 2) -> Path:
    """`odrl train --nproc N` on the GPUs; the run's folder."""
    run = out / name
    command = [sys.executable, "-m", "omni_diffusion_rl.cli", "train", "--nproc", str(processes), *overrides]
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


def memory_checks() -> tuple[dict[str, bool], list[dict]]:
    """The traces against the GPU's own allocator, per family and phase."""
    from omni_diffusion_rl.benchmarks.memory_trace_check import GPU_CASES, compare_on_cuda

    rows = [compare_on_cuda(family, train) for family in GPU_CASES for train in (True, False)]
    print("| family | phase | traced (GiB) | tracked on the GPU | cuda max allocated | trace - allocated |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['case']} | {r['phase']} | {r['traced_gib']:.3f} | {r['tracked_on_gpu_gib']:.3f} "
            f"| {r['cuda_max_allocated_gib']:.3f} | {r['relative_difference']:+.1%} |"
        )
    checks = {
        f"memory: {r['family']} {r['phase']}: trace within 10% of max_memory_allocated": abs(
            r["relative_difference"]
        )
        <= 0.1
        for r in rows
    }
    return checks, rows


def one_gpu_checks(out: Path, runs: dict[str, Path]) -> dict[str, bool]:
    """The tiny H3 sharded in one process: fp32, a bf16 base and cpu_offload."""
    h3 = [*h3_overrides(out), "train.sharding=fsdp"]
    runs["h3_one"] = train("h3_one", h3, out, 1)
    runs["h3_one_bf16_base"] = train("h3_one_bf16_base", [*h3, "model.base_dtype=bf16"], out, 1)
    runs["h3_one_offload"] = train("h3_one_offload", [*h3, "train.cpu_offload=true"], out, 1)
    pairs = zip(records(runs["h3_one"]), records(runs["h3_one_bf16_base"]), strict=True)
    return {
        f"h3, 1 process: cpu_offload = no offload (<= {TOLERANCE})": (
            largest_gap(runs["h3_one"], runs["h3_one_offload"]) <= TOLERANCE
        ),
        "h3, 1 process: bf16 base losses within 5% of fp32": all(
            abs(low["loss/total"] - full["loss/total"]) <= 0.05 * abs(full["loss/total"])
            for full, low in pairs
        ),
    }


def two_gpu_checks(out: Path, runs: dict[str, Path]) -> dict[str, bool]:
    """Unsharded against sharded, and bf16 mixed precision, on 2 processes."""
    sharded = ["train.sharding=fsdp"]
    runs["tiny_whole"] = train("tiny_whole", TINY, out)
    runs["tiny_sharded"] = train("tiny_sharded", [*TINY, *sharded], out)
    runs["tiny_sharded_bf16"] = train(
        "tiny_sharded_bf16", [*TINY, *sharded, "train.mixed_precision=bf16"], out
    )
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
    return checks


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--output", type=Path, default=Path("runs/gpu_check_sharding"))
    parser.add_argument("--memory-only", action="store_true", help="only the memory checks (about a minute)")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    if gpus < 1:
        print("needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    out = args.output.resolve()
    out.mkdir(parents=True, exist_ok=True)
    checks, memory_rows = memory_checks()
    runs: dict[str, Path] = {}
    if not args.memory_only:
        checks |= one_gpu_checks(out, runs)
        if gpus >= 2:
            checks |= two_gpu_checks(out, runs)
        else:
            print("1 GPU: the 2-process sharding checks need 2 (skipped)")
    if runs:
        print("| run | max GPU memory per process (GiB) |\n| --- | --- |")
        for name, run in runs.items():
            print(f"| {name} | {peak_gib(run):.3f} |")
    for check, ok in checks.items():
        print(f"{'ok  ' if ok else 'FAIL'} {check}")
    memory = {name: peak_gib(run) for name, run in runs.items()}
    report = {"gpus": gpus, "checks": checks, "memory_traces": memory_rows, "max_allocated_gib": memory}
    (out / "results.json").write_text(json.dumps(report, indent=1))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
