"""Sharded training (train.sharding=fsdp): torch's FSDP2 over the processes that train together.

Each repeated transformer block of the policy (its frozen base weights and both LoRA adapters) is
wrapped with `fully_shard`, then the transformer itself, so every process holds 1/N of each weight
and a block is gathered whole only while it computes. Stored dtypes are kept (a bf16 base stays bf16,
the adapters fp32) and gradients are reduced in fp32 (`MixedPrecisionPolicy(reduce_dtype=fp32)`);
bf16 compute comes from the same autocast as the unsharded path (precision.py), so sharding changes
where weights live, never the math. `train.cpu_offload` keeps the shards in host memory between uses.

Everything that leaves the process group (checkpoints, weight syncs, exports) goes through
`full_tensor` here: a collective every process of the mesh must call in the same order, so those
paths run on every trainer process, not only the one that writes. The in-process teacher is sharded
the same way, forward only, on a process group of its own (it computes on another thread).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor

from ..config import ConfigError, ExperimentConfig

BLOCK_LIST_NAMES = ("blocks", "transformer_blocks", "single_transformer_blocks", "layers", "refiner_blocks")
"""nn.ModuleList attribute names taken as repeated blocks when a model declares none."""


class ShardingError(ConfigError):
    """train.sharding=fsdp cannot apply to this model or launch."""


@dataclass(frozen=True)
class ShardingChoice:
    """Whether to shard, and who asked: the config or accelerate launch's FSDP config."""

    enabled: bool
    cpu_offload: bool
    source: str

    def describe(self, processes: int) -> str:
        if not self.enabled:
            whole = f"each of the {processes} training processes holds whole weights"
            return f"sharding: none ({self.source}): {whole}"
        offload = ", shards kept in host memory (cpu_offload)" if self.cpu_offload else ""
        return f"sharding: FSDP2 over {processes} training processes ({self.source}){offload}"


def sharding_choice(cfg: ExperimentConfig, env: dict[str, str] | None = None) -> ShardingChoice:
    """train.sharding / train.cpu_offload, or accelerate launch's FSDP config (ACCELERATE_USE_FSDP,
    FSDP_VERSION, FSDP_OFFLOAD_PARAMS), which turns sharding on; FSDP version 1 is refused."""
    choice = _choice(cfg, dict(os.environ if env is None else env))
    if not choice.enabled and cfg.train.cpu_offload:
        raise ShardingError(
            "train.cpu_offload=true offloads the shards of a sharded model: set train.sharding=fsdp too "
            "(or train.cpu_offload=false)"
        )
    if choice.enabled and cfg.execution.mode == "auto":
        raise ShardingError(
            f"execution.mode=auto measures each mode's costs on whole, unsharded copies of the model, which "
            f"is not what a sharded run does ({choice.source}): choose execution.mode=colocated, separate "
            "or hybrid (`odrl simulate --measure` predicts them)"
        )
    return choice


def _choice(cfg: ExperimentConfig, env: dict[str, str]) -> ShardingChoice:
    if env.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true", "yes"):
        version = env.get("FSDP_VERSION", "1")
        if version != "2":
            raise ShardingError(
                f"accelerate launch's FSDP config asks for fsdp_version {version}: omni-diffusion-rl shards "
                "with FSDP2 only; set `fsdp_version: 2` in the config file (or use train.sharding=fsdp "
                "without an FSDP config)"
            )
        offload = env.get("FSDP_OFFLOAD_PARAMS", "false").lower() == "true"
        return ShardingChoice(
            True,
            offload or cfg.train.cpu_offload,
            f"accelerate launch's FSDP config, fsdp_version 2, offload_params {str(offload).lower()}",
        )
    if cfg.train.sharding == "fsdp":
        return ShardingChoice(True, cfg.train.cpu_offload, "train.sharding=fsdp")
    return ShardingChoice(False, False, "train.sharding=none")


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The model's repeated blocks: the classes it names in diffusers' `_repeated_blocks` or
    `_no_split_modules`, else the items of its block lists (BLOCK_LIST_NAMES); outermost only."""
    names = list(getattr(model, "_repeated_blocks", None) or getattr(model, "_no_split_modules", None) or [])
    if names:
        found = [m for m in model.modules() if m is not model and type(m).__name__ in names]
    else:
        found = []
        for name, child in model.named_modules():
            if isinstance(child, nn.ModuleList) and name.rsplit(".", 1)[-1] in BLOCK_LIST_NAMES:
                found += [m for m in child if any(True for _ in m.parameters())]
    outermost = []
    for module in found:
        if not any(other is not module and _contains(other, module) for other in found):
            outermost.append(module)
    return outermost


def _contains(outer: nn.Module, inner: nn.Module) -> bool:
    return any(m is inner for m in outer.modules())


def check_shardable(model: nn.Module, family: str) -> list[nn.Module]:
    """The blocks to shard, or a ShardingError naming the family and why it cannot be sharded."""
    units = shard_units(model)
    if not units:
        raise ShardingError(
            f"train.sharding=fsdp: model.family={family} cannot be sharded: its transformer "
            f"({type(model).__name__}) has no repeated blocks (diffusers' _repeated_blocks or "
            f"_no_split_modules, or an nn.ModuleList named one of {', '.join(BLOCK_LIST_NAMES)}) to shard "
            "one at a time; "
            "set train.sharding=none"
        )
    return units


def process_group_mesh(group: Any, device: torch.device, cpu_offload: bool = False) -> DeviceMesh:
    """A 1-D device mesh over `group` (None: every process) on the device type of `device`. With
    cpu_offload on CUDA the mesh gets a group of its own with a gloo backend for the CPU too: the
    offloaded shards' gradients are clipped, and the shards gathered whole, on the CPU."""
    if device.type == "cuda" and cpu_offload:
        group = dist.new_group(_ranks(group), backend="cpu:gloo,cuda:nccl", use_local_synchronization=True)
    if group is None:
        return init_device_mesh(device.type, (dist.get_world_size(),))
    return DeviceMesh.from_group(group, device.type)


def _ranks(group: Any) -> list[int]:
    """The global ranks of `group` (None: every process)."""
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def shard_module(model: nn.Module, units: list[nn.Module], mesh: DeviceMesh, cpu_offload: bool) -> None:
    """fully_shard each unit, then the model (what the units leave: embeddings, norms, output).

    Every group, the root's too, splits its weights again after each forward: FSDP would keep the
    root's gathered until a backward, which sampling, evaluation and a teacher never run, and a
    weight loaded, copied or soft-updated while gathered would be lost at the next reshard."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    precision = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cpu_offload else OffloadPolicy()
    for module in [*units, model]:
        fully_shard(
            module, mesh=mesh, mp_policy=precision, offload_policy=offload, reshard_after_forward=True
        )
    model.__dict__[COMPUTE_DEVICE] = mesh_device(mesh)


COMPUTE_DEVICE = "_odrl_compute_device"


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device a mesh computes on in this process (its current CUDA device, or the CPU)."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def compute_device(module: nn.Module) -> torch.device:
    """Where `module` computes: a sharded module's mesh device (its shards may live in host memory
    with cpu_offload), else its parameters' device."""
    recorded = module.__dict__.get(COMPUTE_DEVICE)
    return recorded if recorded is not None else next(module.parameters()).device


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor: gathered from every process of its mesh (a collective) for a shard."""
    return t.full_tensor() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_whole_into(target: torch.Tensor, whole: torch.Tensor) -> None:
    """target <- whole, for a plain tensor or a shard (each process keeps its own part; no collective)."""
    if isinstance(target, DTensor):
        part = distribute_tensor(
            whole.to(device=target.device, dtype=target.dtype),
            target.device_mesh,
            target.placements,
            src_data_rank=None,
        )
        target.copy_(part)
    else:
        target.copy_(whole)


def whole_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """optimizer.state_dict() with every sharded state tensor gathered whole (a collective on every
    process), so it is the very dict an unsharded run saves."""
    state = optimizer.state_dict()
    state["state"] = {
        index: {k: _whole_copy(v) for k, v in entry.items()} for index, entry in state["state"].items()
    }
    return state


def _whole_copy(value: Any) -> Any:
    """A tensor gathered whole (a shard) or copied (so the dict shares nothing with the optimizer)."""
    if isinstance(value, DTensor):
        return value.full_tensor().detach().cpu()
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def load_whole_optimizer_state(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load an unsharded optimizer state dict into an optimizer over shards (or plain parameters):
    each process keeps its part of every moment tensor."""
    optimizer.load_state_dict(state)
    for group in optimizer.param_groups:
        for param in group["params"]:
            entry = optimizer.state.get(param)
            if not entry or not isinstance(param, DTensor):
                continue
            for key, value in entry.items():
                if (
                    isinstance(value, torch.Tensor)
                    and not isinstance(value, DTensor)
                    and value.shape == param.shape
                ):
                    entry[key] = distribute_tensor(
                        value.to(param.device), param.device_mesh, param.placements, src_data_rank=None
                    )


def local_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes this process stores for `tensors` (a shard's local storage, padding included)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storage = local.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


@dataclass
class Sharder:
    """How this run shards (the choice, the training processes' group and device): places the
    policy's transformer (`policy`) and an in-process teacher's (`teacher`, on a process group of
    its own, created on first use by every training process)."""

    choice: ShardingChoice
    family: str
    group: Any  # the training processes (None: every process)
    device: torch.device
    world_size: int
    _teacher_mesh: DeviceMesh | None = None

    @property
    def active(self) -> bool:
        """Whether weights are split at all (one training process keeps them whole, checked alike)."""
        return self.world_size > 1

    def policy(self, transformer: nn.Module) -> None:
        units = check_shardable(transformer, self.family)
        mesh = process_group_mesh(self.group, self.device, self.choice.cpu_offload)
        shard_module(transformer, units, mesh, self.choice.cpu_offload)

    def teacher(self, transformer: nn.Module, family: str) -> None:
        """Shard a frozen teacher's transformer (forward only) over the training processes."""
        units = check_shardable(transformer, family)
        if not self.active:
            return
        if self._teacher_mesh is None:
            backend = "cpu:gloo,cuda:nccl" if self.device.type == "cuda" and self.choice.cpu_offload else None
            group = dist.new_group(_ranks(self.group), backend=backend, use_local_synchronization=True)
            self._teacher_mesh = DeviceMesh.from_group(group, self.device.type)
        shard_module(transformer, units, self._teacher_mesh, self.choice.cpu_offload)


def make_sharder(
    cfg: ExperimentConfig, world_size: int, group: Any, device: torch.device, trains_answers: bool
) -> tuple[Sharder | None, str]:
    """The run's sharder (None: unsharded) and the sentence that says which sharding is in force."""
    choice = sharding_choice(cfg)
    if not choice.enabled:
        return None, choice.describe(world_size)
    if trains_answers:
        raise ShardingError(
            f"train.sharding=fsdp: model.family={cfg.model.family} with algorithm.name={cfg.algorithm.name} "
            "cannot be sharded: its answer sampler stops when every answer on a process has ended, so "
            "the processes would run different numbers of forward passes and FSDP's per-block gathers "
            "would not line up; set train.sharding=none"
        )
    sharder = Sharder(choice, cfg.model.family, group, device, world_size)
    if world_size == 1:
        return sharder, f"sharding: none ({choice.source}, but one training process keeps whole weights)"
    return sharder, choice.describe(world_size)
