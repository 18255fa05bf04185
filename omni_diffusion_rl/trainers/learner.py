"""What an algorithm optimizes: the policy, its trained parameters and optimizer, and the processes
that train together (gradients averaged over them, each weighted by its trained samples).

A `Learner` knows nothing of where experience comes from or of the training loop; the trainer builds
one, and a benchmark or a test can build one around any policy and optimizer.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..config import ExperimentConfig
from ..models import build_nft_policy, lora
from ..models.policy import FlowPolicy
from ..precision import autocast_factory, resolve_mixed_precision
from ..registry import algorithms
from ..reward import RewardError
from ..runtime.distributed import PeerDataError, all_gather_cat, all_gather_json, all_reduce_sum
from ..runtime.sharding import Sharder, check_shardable, full_tensor, make_sharder


@dataclass
class Learner:
    """The policy under training on this process and the process group it trains with (None: the
    default group, or this process alone when `world_size` is 1)."""

    cfg: ExperimentConfig
    policy: FlowPolicy
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    rank: int = 0
    world_size: int = 1
    group: Any = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # the context forward passes run in (precision.py: bf16 autocast, or none); losses stay fp32
    autocast: Callable[[], contextlib.AbstractContextManager[object]] = contextlib.nullcontext
    # sharded (train.sharding=fsdp): FSDP reduces the gradients, and every process runs the same passes
    sharded: bool = False
    loss_scale: float = 1.0  # what `backward` multiplies each loss by (set by begin_update when sharded)

    @property
    def transformer(self) -> torch.nn.Module:
        return self.policy.transformer

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """`t` of every process, concatenated in rank order."""
        return all_gather_cat(t, self.group, self.device) if self.world_size > 1 else t

    def agree_on_failure(self, error: BaseException | None, what: str) -> None:
        """Raise on every process when one failed (the others would wait for it in a collective)."""
        failed = error is not None
        if self.world_size > 1:
            flag = all_reduce_sum(torch.tensor([1.0 if failed else 0.0]), self.group, self.device)
            failed = bool(flag.item() > 0)
        if error is not None:
            raise error
        if failed:
            raise RewardError(f"another process failed while {what}; its error is in its own output")

    def gather_named(self, parts: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Each named per-sample tensor gathered over processes; a name some process lacks is NaN there."""
        names = sorted(parts)
        if self.world_size > 1:
            everyone = all_gather_json(names, self.group, self.device)
            if not all(isinstance(ns, list) and all(isinstance(n, str) for n in ns) for ns in everyone):
                raise PeerDataError(
                    f"a trainer process sent metric names that are not a list of strings: {everyone}"
                )
            names = sorted({n for ns in everyone for n in ns})
        size = len(next(iter(parts.values()))) if parts else 0
        nan = torch.full((size,), float("nan"))
        return {n: self.gather(parts.get(n, nan)) for n in names}

    def weighted_mean_over_ranks(
        self, metrics: dict[str, float], weight: float, names: list[str]
    ) -> dict[str, float]:
        """sum_i w_i m_i / sum_i w_i over processes for `names` (w_i: trained samples); a process
        with none contributes nothing (its metrics may be empty)."""
        if self.world_size == 1:
            return {n: metrics.get(n, float("nan")) for n in names}
        values = torch.tensor([metrics.get(n, 0.0) * weight for n in names] + [weight], dtype=torch.float64)
        values = all_reduce_sum(values, self.group, self.device)
        total = float(values[-1])
        return {
            n: float(v) / total if total > 0 else float("nan")
            for n, v in zip(names, values[:-1], strict=True)
        }

    def begin_update(self, weight: float, passes_over: int) -> None:
        """Before an update's backward passes: zero the gradients; sharded, scale this process's
        losses by N w_i / sum_j w_j (w: its trained samples), so that FSDP's mean over N processes is
        the sample-weighted mean, and check that every process runs its passes over `passes_over`
        samples (FSDP gathers each block in lockstep: unequal passes would hang)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.loss_scale = 1.0
        if not self.sharded or self.world_size == 1:
            return
        mine = torch.tensor([[float(weight), float(passes_over)]], dtype=torch.float64)
        everyone = self.gather(mine)
        if bool((everyone[:, 1] != everyone[0, 1]).any()):
            counts = [int(n) for n in everyone[:, 1].tolist()]
            raise RuntimeError(
                f"sharded training needs the same samples per process; the processes hold {counts} "
                "(data.prompts_per_step must split evenly over the training processes)"
            )
        total = float(everyone[:, 0].sum())
        self.loss_scale = self.world_size * float(weight) / total if total > 0 else 0.0

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward(), scaled for FSDP's reduction when sharded (see begin_update)."""
        (loss if self.loss_scale == 1.0 else loss * self.loss_scale).backward()

    def average_gradients(self, weight: float = 1.0) -> None:
        """Gradients averaged over processes, each weighted by its trained samples (`weight`); sharded,
        FSDP has reduced them already (with the weights as loss scales)."""
        if self.world_size == 1 or self.sharded:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        weights = torch.tensor([float(weight)], device=grads[0].device)
        flat = torch.cat([g.flatten() * weight for g in grads] + [weights])
        flat = all_reduce_sum(flat, self.group, self.device)
        total, flat = flat[-1], flat[:-1]
        flat /= total
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n

    def apply_gradients(self, metrics: dict[str, float], weight: float = 1.0) -> None:
        """Average gradients over processes (weighted by `weight`, this process's samples), clip, step."""
        self.average_gradients(weight)
        if self.cfg.optim.grad_clip > 0:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.cfg.optim.grad_clip)
            metrics["grad_norm"] = float(full_tensor(norm))  # sharded: the norm over every shard
        self.optimizer.step()


def rank_and_size(accelerator: Any = None, group: Any = None) -> tuple[int, int]:
    """This process's rank and the number of processes that train together: those of `group`, else
    the accelerator's processes, else this process alone."""
    if group is not None:
        return dist.get_rank(group), dist.get_world_size(group)
    if accelerator is not None:
        return accelerator.process_index, accelerator.num_processes
    return 0, 1


def build_learner(
    cfg: ExperimentConfig, device: torch.device, rank: int, world_size: int, group: Any = None
) -> tuple[Learner, Sharder | None, str]:
    """The policy (sharded over the training processes with train.sharding=fsdp), its trained LoRA
    parameters, their AdamW optimizer and the run's precision, as a learner; the sharder and a line
    that says which sharding is in force."""
    trains_answers = algorithms.get(cfg.algorithm.name).experience_kind == "answers"
    sharder, sharding = make_sharder(cfg, world_size, group, device, trains_answers)
    if rank == 0 and world_size > 1:  # said before the (possibly long) build of the policy
        print(f"odrl: {sharding}", file=sys.stderr, flush=True)
    sharded = sharder is not None and sharder.active
    policy = build_nft_policy(cfg.model, device, sharder.policy if sharded else None)
    if sharder is not None and not sharded:  # one process: whole weights, checked alike
        check_shardable(policy.transformer, cfg.model.family)
    params = lora.trainable_parameters(policy.transformer)
    optimizer = torch.optim.AdamW(params, lr=cfg.optim.lr, weight_decay=cfg.optim.weight_decay)
    autocast = autocast_factory(resolve_mixed_precision(cfg.train.mixed_precision), device)
    learner = Learner(cfg, policy, params, optimizer, rank, world_size, group, device, autocast, sharded)
    return learner, sharder, sharding
