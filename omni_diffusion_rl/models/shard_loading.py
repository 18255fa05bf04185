"""A sharded transformer's weights read a process's part at a time.

Unsharded, `from_pretrained` reads the whole transformer into host memory, and so did every process
of a sharded run before FSDP2 kept 1/N of it: 8 processes of MiniMax-H3 held 8 x 62 GiB of host
memory at start-up, and each read the whole 66 GB of files. Within `deferred_weights()`, the
ltx2 and minimax_h3 families build their transformer as a skeleton instead: its module tree from the
folder's config, its parameters allocated but never written (the OS gives untouched memory no pages)
and its buffers computed as diffusers computes them. The adapters are added and sharding places each
process's part as before; then `load_deferred_weights` reads each process's own rows of every weight
from the safetensors files into its shard, a tensor at a time with plain reads (nothing stays
mapped; the header is bounded and every byte range checked against the file).

The weights are bit for bit those `from_pretrained` loads: floating weights cast to the base dtype,
the model's `_keep_in_fp32_modules` in fp32, persistent buffers from the file
(`tests/test_shard_loading.py` compares them shard for shard). A folder without safetensors
files (old `.bin` weights) loads whole, as before.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
INDEX_NAME = WEIGHTS_NAME + ".index.json"
MAX_INDEX_BYTES = 64 << 20
"""An index file larger than this is refused (a real one lists a few thousand names)."""
DEFERRED = "_odrl_deferred_weights"
"""The attribute of a skeleton transformer that says where its weights are (a WeightFiles)."""

_deferring: ContextVar[bool] = ContextVar("odrl_deferred_weights", default=False)


class WeightLoadError(ValueError):
    """A skeleton's weights cannot be read: a name or shape missing from, or wrong in, its files."""


MAX_HEADER_BYTES = 100 << 20
"""A safetensors header larger than this is refused (a 66 GB transformer's is under 1 MiB)."""
FILE_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class StoredTensor:
    """Where one tensor's bytes are in a safetensors file (rows laid out one after another)."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # of its first byte in the file

    @property
    def row_elements(self) -> int:
        return int(torch.Size(self.shape[1:]).numel()) if self.shape else 1


def read_header(path: Path) -> dict[str, StoredTensor]:
    """The tensors of a safetensors file, from its header (bounded; every range checked against
    the file's size and the tensor's shape and dtype)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise WeightLoadError(f"{path}: not a safetensors file (a header of {length} bytes)")
        header = json.loads(f.read(length).decode("utf-8"))
    if not isinstance(header, dict):
        raise WeightLoadError(f"{path}: its header is not a JSON object")
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = FILE_DTYPES[entry["dtype"]]
            shape = tuple(int(d) for d in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise WeightLoadError(
                f"{path}: the header's entry for {name!r} is not one safetensors writes"
            ) from e
        expected = int(torch.Size(shape).numel()) * dtype.itemsize
        if (
            min(shape, default=0) < 0
            or not 0 <= begin <= end
            or end - begin != expected
            or 8 + length + end > size
        ):
            raise WeightLoadError(
                f"{path}: the bytes of {name!r} fit neither its shape {list(shape)} nor the file"
            )
        tensors[str(name)] = StoredTensor(path, dtype, shape, 8 + length + begin)
    return tensors


def read_rows(stored: StoredTensor, start: int, count: int) -> torch.Tensor:
    """Rows [start, start + count) of a stored tensor (all of a 0-d one), read from the file into
    a new tensor: only those bytes are read, and nothing stays mapped afterwards."""
    shape = (count, *stored.shape[1:]) if stored.shape else ()
    with unfilled_memory():  # every byte is read below
        out = torch.empty(shape, dtype=stored.dtype)
    target = memoryview(out.view(torch.uint8).numpy()).cast("B") if out.numel() else memoryview(b"")
    with open(stored.path, "rb", buffering=0) as f:
        f.seek(stored.offset + start * stored.row_elements * stored.dtype.itemsize)
        done = 0
        while done < len(target):
            got = f.readinto(target[done:])
            if not got:
                raise WeightLoadError(f"{stored.path}: the file ended inside a tensor")
            done += got
    return out


@dataclass(frozen=True)
class WeightFiles:
    """Where each tensor of a transformer folder's safetensors files is."""

    folder: Path
    file_of: dict[str, StoredTensor]


@contextlib.contextmanager
def deferred_weights() -> Iterator[None]:
    """Within it, `load_transformer` builds skeletons (for a sharded build: build_nft_policy)."""
    token = _deferring.set(True)
    try:
        yield
    finally:
        _deferring.reset(token)


def load_transformer(cls: Any, source: str, subfolder: str, dtype: torch.dtype) -> nn.Module:
    """`cls.from_pretrained(source, subfolder=..., torch_dtype=dtype)`, or, within
    `deferred_weights()` and with the weights in safetensors files, a skeleton of it whose weights
    `load_deferred_weights` reads later."""
    if not _deferring.get():
        return cls.from_pretrained(source, subfolder=subfolder, torch_dtype=dtype)
    folder = _local_folder(source, subfolder)
    files = weight_files(folder) if folder is not None else None
    if files is None:
        return cls.from_pretrained(source, subfolder=subfolder, torch_dtype=dtype)
    return skeleton(cls, files, dtype, name_or_path=source)


def _local_folder(source: str, subfolder: str) -> Path | None:
    """The component's folder on this machine: under a local directory, else in the hub cache
    (downloaded if the hub may be reached, as from_pretrained would); None where it cannot be had."""
    local = Path(source)
    if local.is_dir():
        return local / subfolder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(source, allow_patterns=[f"{subfolder}/*"])) / subfolder
    except Exception:  # noqa: BLE001 - from_pretrained then raises its own, clearer error
        return None


def weight_files(folder: Path, weights_name: str = WEIGHTS_NAME) -> WeightFiles | None:
    """The folder's safetensors weights (`weights_name`, or its index naming several files; diffusers'
    names by default, transformers' are `model.safetensors`), None without."""
    index = folder / f"{weights_name}.index.json"
    if index.is_file():
        with open(index, "rb") as f:
            data = f.read(MAX_INDEX_BYTES + 1)
        if len(data) > MAX_INDEX_BYTES:
            raise WeightLoadError(f"{index} is larger than {MAX_INDEX_BYTES >> 20} MiB")
        weight_map = json.loads(data.decode("utf-8")).get("weight_map")
        if not isinstance(weight_map, dict):
            raise WeightLoadError(f"{index} has no weight_map object")
        paths = set()
        for file in weight_map.values():
            path = (folder / str(file)).resolve()
            if path.parent != folder.resolve():
                raise WeightLoadError(f"{index} names {file!r}, which is not a file of {folder}")
            paths.add(path)
    elif (folder / weights_name).is_file():
        paths = {folder / weights_name}
    else:
        return None
    stored: dict[str, StoredTensor] = {}
    for path in sorted(paths):
        stored |= read_header(path)
    return WeightFiles(folder, stored)


def skeleton(cls: Any, files: WeightFiles, dtype: torch.dtype, name_or_path: str) -> nn.Module:
    """The model `cls` of the folder's config with parameters allocated and unwritten (dtypes as
    from_pretrained gives them), buffers computed by its constructor at `dtype`, in eval mode."""
    from accelerate import init_empty_weights

    from ..precision import default_dtype

    config = cls.load_config(str(files.folder))
    with default_dtype(dtype), init_empty_weights(include_buffers=False):
        model = cls.from_config(config)
    keep_fp32 = list(getattr(cls, "_keep_in_fp32_modules", None) or [])

    def stored(name: str, tensor: torch.Tensor) -> torch.dtype:  # load_model_dict_into_meta's casts
        if not tensor.dtype.is_floating_point:
            return tensor.dtype
        return torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype

    with unfilled_memory():
        for name, param in list(model.named_parameters()):
            owner, attribute = _owner(model, name)
            owner._parameters[attribute] = nn.Parameter(
                torch.empty(param.shape, dtype=stored(name, param)), requires_grad=param.requires_grad
            )
    for name, buffer in list(model.named_buffers()):
        if name in files.file_of:  # a persistent buffer the files hold: read later, cast as they are
            owner, attribute = _owner(model, name)
            owner._buffers[attribute] = buffer.to(stored(name, buffer))
    model.register_to_config(_name_or_path=name_or_path)
    model.eval()
    model.__dict__[DEFERRED] = files
    return model


@contextlib.contextmanager
def unfilled_memory() -> Iterator[None]:
    """New tensors left unwritten, as torch.empty promises: with deterministic algorithms on (as
    the trainer runs), torch fills them, which would give a skeleton's whole size real pages."""
    import torch.utils.deterministic

    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill


def _owner(model: nn.Module, name: str) -> tuple[nn.Module, str]:
    owner_name, _, attribute = name.rpartition(".")
    return (model.get_submodule(owner_name) if owner_name else model), attribute


def has_deferred_weights(model: nn.Module) -> bool:
    return DEFERRED in model.__dict__


@torch.no_grad()
def load_deferred_weights(model: nn.Module) -> int:
    """Read a skeleton's weights: each parameter's own rows (a shard's, or the whole tensor) and
    every persistent buffer the files hold. LoRA parameters (named `lora_`) are the adapters' own
    and are left as they are. Returns the bytes read."""
    files: WeightFiles = model.__dict__.pop(DEFERRED)
    wanted = {_file_name(name): tensor for name, tensor in model.named_parameters() if "lora_" not in name}
    missing = sorted(name for name in wanted if name not in files.file_of)
    if missing:
        raise WeightLoadError(
            f"{files.folder}: the weights of {len(missing)} parameter(s) are in no safetensors file "
            f"({', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''}): is it the folder of this "
            "model class, written by save_pretrained?"
        )
    buffers = {_file_name(n): b for n, b in model.named_buffers() if _file_name(n) in files.file_of}
    read = sum(_load_parameter(param, files.file_of[name], name) for name, param in wanted.items())
    for name, buffer in buffers.items():
        read += _load_whole(buffer, files.file_of[name], name)
    return read


def _file_name(name: str) -> str:
    """A parameter's name in the files: peft's wrapped layers keep the base under `base_layer`."""
    return name.replace(".base_layer.", ".")


def _check_shape(target: torch.Tensor, stored: StoredTensor, name: str) -> None:
    if stored.shape != tuple(target.shape):
        raise WeightLoadError(
            f"{stored.path}: {name} is {list(stored.shape)} there, the model wants {list(target.shape)}"
        )


def _load_parameter(param: torch.Tensor, stored: StoredTensor, name: str) -> int:
    """Copy a sharded parameter's rows (FSDP2's dim-0 split) or a whole one from its file."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(param, DTensor):
        return _load_whole(param, stored, name)
    _check_shape(param, stored, name)
    if tuple(param.placements) != (Shard(0),):
        raise WeightLoadError(
            f"{name}: a shard placed {param.placements} (only dim-0 shards are read by rows)"
        )
    local = param.to_local()
    chunk = -(-stored.shape[0] // param.device_mesh.size())
    start = param.device_mesh.get_local_rank() * chunk
    if local.shape[0] and start + local.shape[0] > stored.shape[0]:
        raise WeightLoadError(
            f"{name}: rows {start}.. of {list(stored.shape)} do not make the shard {list(local.shape)}"
        )
    part = read_rows(stored, start, local.shape[0])
    value = part.to(dtype=local.dtype, device=local.device)
    param.copy_(
        DTensor.from_local(
            value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
        )
    )
    return part.numel() * part.element_size()


def _load_whole(target: torch.Tensor, stored: StoredTensor, name: str) -> int:
    _check_shape(target, stored, name)
    value = read_rows(stored, 0, stored.shape[0] if stored.shape else 1)
    target.copy_(value.to(dtype=target.dtype, device=target.device))
    return value.numel() * value.element_size()
