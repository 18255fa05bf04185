"""Benchmark: the cost of one DiffusionNFT optimizer step against a plain flow-matching step.

Three arms share one tiny model, its two LoRA adapters, one AdamW optimizer, one batch and one
timestep count:

* ``fm``: plain flow-matching fine-tuning (trained-adapter forward + backward per timestep);
* ``nft``: the real ``DiffusionNFT.train_on`` with KL off (plus the `old`-adapter forward);
* ``nft_kl``: the same with ``kl_coef > 0`` (plus a reference forward with adapters disabled).

Rounds run the arms interleaved (fm, nft, nft_kl, fm, ...) so drift from other load hits each arm
alike; the report gives the median and min seconds per trained sample and the ratios to ``fm``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..algorithms.nft import flow_matching_loss
from ..config import DataConfig, ExperimentConfig
from ..experience.rollout import Rollout
from ..experience.sampling import time_grid
from ..models import lora
from ..models.tiny_av import BUILTIN_WEIGHTS, DEFAULT_LORA_TARGETS, TinyAVPolicy, TinyAVTransformer
from ..trainers.learner import Learner
from ..trainers.nft import DiffusionNFT
from ..trainers.skeleton import noised_inputs
from ..world import tiny_world as world
from .common import machine_info

ARMS = ("fm", "nft", "nft_kl")
ARM_LABELS = {"fm": "plain FM", "nft": "NFT (KL off)", "nft_kl": "NFT (KL on)"}
TARGET_RATIO_KL_OFF = 1.6
KL_COEF = 1e-4
LORA_RANK, LORA_ALPHA = 16, 32.0
SEED = 0


def build_bench_policy(model_path: str | None = None) -> tuple[TinyAVPolicy, str]:
    """The tiny policy (shipped or given weights, else random init) and where it came from."""
    if model_path is not None:
        return TinyAVPolicy.from_pretrained(model_path), str(model_path)
    if (BUILTIN_WEIGHTS / "config.json").is_file():
        return TinyAVPolicy.from_pretrained("builtin"), "builtin"
    torch.manual_seed(SEED)
    return TinyAVPolicy(TinyAVTransformer()), "random-init (builtin weights absent)"


def bench_group_size(batch_size: int) -> int:
    """Samples per prompt group: the config's default group size if it divides the batch, else a divisor."""
    return math.gcd(batch_size, DataConfig().group_size)


def make_rollout(policy: TinyAVPolicy, batch_size: int, timesteps: int) -> Rollout:
    """A fixed batch: random x0, tiny-world prompt groups, and a grid with `timesteps` training times."""
    gen = torch.Generator().manual_seed(SEED)
    group_size = bench_group_size(batch_size)
    group_ids = torch.arange(batch_size) // group_size
    prompts = [world.TRAIN_PROMPTS[int(g) % len(world.TRAIN_PROMPTS)] for g in group_ids]
    x0 = torch.randn((batch_size, *policy.latent_shape), generator=gen)
    return Rollout(
        prompts=prompts,
        group_ids=group_ids,
        x0=x0,
        cond=policy.encode_prompts(prompts),
        grid=time_grid(timesteps),  # timesteps + 1 points; train_on trains on the `timesteps` with t > 0
    )


def make_learner(
    policy: TinyAVPolicy,
    params: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    kl_coef: float,
    group_size: int,
) -> Learner:
    """The benchmark's model and optimizer as a learner (one process), with a config that trains
    every timestep of the grid at `kl_coef`."""
    cfg = ExperimentConfig()
    cfg.algorithm = dataclasses.replace(cfg.algorithm, kl_coef=kl_coef, timestep_fraction=1.0)
    cfg.train = dataclasses.replace(cfg.train, seed=SEED)
    cfg.data = dataclasses.replace(cfg.data, group_size=group_size)
    return Learner(cfg, policy, params, optimizer)


def flow_matching_step(learner: Learner, rollout: Rollout, step: int) -> dict[str, float]:
    """Plain flow-matching fine-tuning step on the learner's own inputs and optimizer step.

    Same timestep draw, noise and x_t (`noised_inputs`), loss scaling, gradient sync, clipping and
    optimizer step (`apply_gradients`) as `DiffusionNFT.train_on`; no `old` or reference forward, no
    NFT loss and no soft update of `old`.
    """
    inputs = noised_inputs(learner.cfg, rollout, step)
    learner.optimizer.zero_grad(set_to_none=True)
    sums: dict[str, float] = {"loss/total": 0.0}
    for t, noise, x_t in inputs:
        v_theta = learner.policy.velocity(x_t, t, rollout.cond)
        loss = flow_matching_loss(v_theta, noise, rollout.x0)
        (loss / len(inputs)).backward()
        sums["loss/total"] += float(loss.detach()) / len(inputs)
    learner.apply_gradients(sums)
    return sums


def _timed(fn: Callable[[], object]) -> float:
    """Seconds one call of `fn` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def format_table(medians: dict[str, float], mins: dict[str, float], ratios: dict[str, float]) -> str:
    """Plain-text table: arm, median and min seconds per trained sample, ratio vs plain FM."""
    lines = [f"{'arm':<14}{'median s/sample':>17}{'min s/sample':>14}{'ratio vs FM':>13}"]
    for arm in ARMS:
        lines.append(f"{ARM_LABELS[arm]:<14}{medians[arm]:>17.6f}{mins[arm]:>14.6f}{ratios[arm]:>13.3f}")
    return "\n".join(lines)


def _trainable_policy(
    model_path: str | None,
) -> tuple[Any, str, list[torch.nn.Parameter], torch.optim.Optimizer]:
    """The bench's policy (and where it came from) with the two NFT adapters, their parameters and
    an AdamW optimizer at the default settings."""
    policy, source = build_bench_policy(model_path)
    transformer = policy.transformer
    transformer.requires_grad_(False)
    lora.add_nft_adapters(transformer, LORA_RANK, LORA_ALPHA, DEFAULT_LORA_TARGETS)
    params = lora.trainable_parameters(transformer)
    optim_cfg = ExperimentConfig().optim
    optimizer = torch.optim.AdamW(params, lr=optim_cfg.lr, weight_decay=optim_cfg.weight_decay)
    transformer.train()
    return policy, source, params, optimizer


def run_nft_step_bench(
    output: Path, repeats: int = 5, batch_size: int = 32, timesteps: int = 6, model_path: str | None = None
) -> dict[str, Any]:
    """Time plain FM, NFT (KL off) and NFT (KL on) steps; print a table and write JSON to `output`."""
    if repeats < 1 or batch_size < 1 or timesteps < 1:
        raise ValueError(
            f"repeats, batch_size and timesteps must be >= 1; got {repeats}, {batch_size}, {timesteps}"
        )
    machine = machine_info()  # before the run: the load average then is the other processes' load
    policy, source, params, optimizer = _trainable_policy(model_path)
    rollout = make_rollout(policy, batch_size, timesteps)
    r = torch.rand(batch_size, generator=torch.Generator().manual_seed(SEED + 1))

    kl_coefs = {"fm": 0.0, "nft": 0.0, "nft_kl": KL_COEF}
    group_size = bench_group_size(batch_size)
    learners = {arm: make_learner(policy, params, optimizer, kl_coefs[arm], group_size) for arm in ARMS}
    nft = {arm: DiffusionNFT(learners[arm]) for arm in ("nft", "nft_kl")}
    steps: dict[str, Callable[[int], object]] = {
        "fm": lambda s: flow_matching_step(learners["fm"], rollout, s),
        "nft": lambda s: nft["nft"].train_on(rollout, r, s),
        "nft_kl": lambda s: nft["nft_kl"].train_on(rollout, r, s),
    }
    for arm in ARMS:  # warm-up round, not timed
        steps[arm](0)
    seconds: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for round_index in range(1, repeats + 1):
        for arm in ARMS:
            seconds[arm].append(_timed(lambda arm=arm, s=round_index: steps[arm](s)))

    per_sample = {arm: [s / batch_size for s in seconds[arm]] for arm in ARMS}
    medians = {arm: statistics.median(v) for arm, v in per_sample.items()}
    mins = {arm: min(v) for arm, v in per_sample.items()}
    ratios = {arm: medians[arm] / medians["fm"] for arm in ARMS}
    ratios_min = {arm: mins[arm] / mins["fm"] for arm in ARMS}
    # Per-round ratios pair each arm with the FM step right before it: robust to slow drift in load.
    paired = {
        arm: statistics.median([s / f for s, f in zip(seconds[arm], seconds["fm"], strict=True)])
        for arm in ARMS
    }
    result: dict[str, Any] = {
        "benchmark": "nft-step",
        "machine": machine,
        "config": {
            "batch_size": batch_size,
            "timesteps": timesteps,
            "group_size": group_size,
            "repeats": repeats,
            "warmup_rounds": 1,
            "model": source,
            "lora_rank": LORA_RANK,
            "lora_alpha": LORA_ALPHA,
            "lora_targets": list(DEFAULT_LORA_TARGETS),
            "kl_coef": KL_COEF,
            "order": list(ARMS),
        },
        "arms": {arm: ARM_LABELS[arm] for arm in ARMS},
        "timings_s_per_step": seconds,
        "timings_s_per_sample": per_sample,
        "median_s_per_sample": medians,
        "min_s_per_sample": mins,
        "ratios": {"nft_kl_off_vs_fm": ratios["nft"], "nft_kl_on_vs_fm": ratios["nft_kl"]},
        "ratios_from_min": {"nft_kl_off_vs_fm": ratios_min["nft"], "nft_kl_on_vs_fm": ratios_min["nft_kl"]},
        "ratios_paired_median": {"nft_kl_off_vs_fm": paired["nft"], "nft_kl_on_vs_fm": paired["nft_kl"]},
        "target_ratio_kl_off": TARGET_RATIO_KL_OFF,
        "meets_target": bool(ratios["nft"] <= TARGET_RATIO_KL_OFF),
    }
    print(format_table(medians, mins, ratios))
    verdict = "meets" if result["meets_target"] else "misses"
    print(f"NFT/FM (KL off) = {ratios['nft']:.3f}: {verdict} the target <= {TARGET_RATIO_KL_OFF}")
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(f"wrote {output}")
    return result


def main(argv: list[str] | None = None) -> int:
    """`python -m omni_diffusion_rl.benchmarks.nft_step`: run the NFT-step benchmark."""
    parser = argparse.ArgumentParser(description="Time an NFT step against a plain flow-matching step.")
    parser.add_argument("--output", type=Path, default=Path("runs/bench/nft_step.json"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--timesteps", type=int, default=6)
    parser.add_argument(
        "--model-path", default=None, help="tiny_av model directory (default: builtin, else random init)"
    )
    args = parser.parse_args(argv)
    run_nft_step_bench(args.output, args.repeats, args.batch_size, args.timesteps, args.model_path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
