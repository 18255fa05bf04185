"""Export a checkpoint's trained LoRA adapter in formats other tools load (`odrl export`).

A checkpoint keeps both NFT adapters (`default`, the trained one, and `old`) in one tensors file
that only this toolkit reads. `export_adapter` rebuilds the policy the way `inference.load_policy`
does (base model from the checkpoint's checked model section, the same fingerprint check, the adapter
tensors checked, no training state or pickle read) and writes the trained adapter as

- `peft`: `adapter_config.json` + `adapter_model.safetensors`, what `PeftModel.save_pretrained`
  writes; `peft.PeftModel.from_pretrained(base_transformer, OUT)` loads it as the `default` adapter.
- `diffusers` (diffusers families with a LoRA loader: sd3, ltx2, minimax_h3):
  `pytorch_lora_weights.safetensors` with `transformer.`-prefixed keys and the LoRA config as
  metadata, what a pipeline's `save_lora_weights` writes; `pipeline.load_lora_weights(OUT)` and
  `transformer.load_lora_adapter(OUT, weight_name="pytorch_lora_weights.safetensors")` load it.

Both directories also hold `odrl_export.json` (where the adapter came from). The output is written
into a temporary sibling directory and renamed into place, and an existing non-empty `out` is
never overwritten.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config import ConfigError

if TYPE_CHECKING:
    from torch import nn

FORMATS = ("peft", "diffusers")
PROVENANCE = "odrl_export.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
DIFFUSERS_WEIGHTS = "pytorch_lora_weights.safetensors"
EXPORT_HELP = (
    "write a checkpoint's trained LoRA adapter for peft (PeftModel) or diffusers (load_lora_weights)"
)

_DIFFUSERS_LORA_SAVERS = {
    "sd3": "SD3LoraLoaderMixin",
    "ltx2": "LTX2LoraLoaderMixin",
    "minimax_h3": "MiniMaxH3LoraLoaderMixin",
}
"""Model family -> the diffusers LoRA loader mixin whose `save_lora_weights` writes its pipeline format."""

_NO_DIFFUSERS_LOADER = {
    "tiny_av": "the built-in tiny_av model is not a diffusers model, so no diffusers loader can read it",
    "stable_audio": "diffusers has no LoRA loader for Stable Audio (StableAudioDiTModel has no "
    "load_lora_adapter and StableAudioPipeline no load_lora_weights)",
}


class ExportError(ConfigError):
    """An export that cannot be made as asked: unknown format, wrong family or an occupied output."""


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format '{fmt}'; choose one of: {', '.join(FORMATS)}")


def _check_output(out: Path) -> None:
    """Refuse an `out` that is a file or a non-empty directory (nothing is ever overwritten)."""
    if out.is_dir():
        if any(out.iterdir()):
            raise ExportError(
                f"output directory {out} is not empty; refusing to overwrite it (choose a new path or "
                "remove it first)"
            )
    elif out.exists() or out.is_symlink():
        raise ExportError(f"output {out} exists and is not a directory; refusing to overwrite it")


def _check_family(fmt: str, family: str) -> None:
    if fmt == "diffusers" and family not in _DIFFUSERS_LORA_SAVERS:
        reason = _NO_DIFFUSERS_LOADER.get(family, f"family '{family}' has no diffusers LoRA format here")
        raise ExportError(
            f"cannot export --format diffusers: {reason}; use --format peft (PeftModel) instead"
        )


def _trained_transformer(checkpoint: str | Path, fmt: str) -> tuple[nn.Module, Any, dict[str, Any]]:
    """(transformer with the checkpoint's adapters, its ModelConfig, provenance), read as `odrl sample`
    reads it (inference.read_trained and trained_policy: the checked model section, the base it
    names, the fingerprint, the checked adapter tensors; no training state)."""
    from .inference import read_trained, trained_policy
    from .models import lora

    trained = read_trained(checkpoint)
    cfg, path = trained.model, trained.path
    _check_family(fmt, cfg.family)
    transformer = trained_policy(trained).transformer
    provenance = {
        "checkpoint": str(path.resolve()),
        "step": trained.state["step"],  # checked by load_checkpoint
        "adapter": f"{lora.TRAINED} (the trained NFT adapter)",
        "family": cfg.family,
        "pretrained": cfg.pretrained,
        "lora_rank": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
    }
    return transformer, cfg, provenance


def _adapter_config(transformer: nn.Module) -> Any:
    """A copy of the trained adapter's LoraConfig as PeftModel.save_pretrained saves it.

    base_model_name_or_path stays unset, as PeftModel leaves it for diffusers models (a local path
    there makes peft's save_pretrained reload that config); odrl_export.json names the base model.
    """
    from .models import lora

    config = copy.deepcopy(transformer.peft_config[lora.TRAINED])
    config.inference_mode = True
    return config


def _write_peft(transformer: nn.Module, directory: Path) -> None:
    """adapter_config.json + adapter_model.safetensors with PeftModel's key names (`base_model.model.`)."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    from .models import lora

    weights = get_peft_model_state_dict(transformer, adapter_name=lora.TRAINED, save_embedding_layers=False)
    # A wrapper whose base model is one of its modules (qwen2_5_omni: `thinker.`) names it by
    # `peft_base`: the keys are that module's, the file loads onto it alone.
    base_name = getattr(transformer, "peft_base", "")
    prefix = f"{base_name}." if base_name else ""
    if any(not k.startswith(prefix) for k in weights):
        raise ExportError(f"the adapter has tensors outside {base_name}, the model peft loads it onto")
    # A PeftModel holds the network as `base_model.model`; its saved keys carry that prefix.
    weights = {
        f"base_model.model.{k.removeprefix(prefix)}": v.detach().cpu().contiguous()
        for k, v in weights.items()
    }
    save_file(weights, str(directory / PEFT_WEIGHTS), metadata={"format": "pt"})
    model_class = type(transformer.get_submodule(base_name) if base_name else transformer)
    auto_mapping = {"base_model_class": model_class.__name__, "parent_library": model_class.__module__}
    _adapter_config(transformer).save_pretrained(str(directory), auto_mapping_dict=auto_mapping)


def _write_diffusers(transformer: nn.Module, family: str, directory: Path) -> None:
    """pytorch_lora_weights.safetensors as the family's pipeline `save_lora_weights` writes it."""
    import diffusers.loaders
    from peft import get_peft_model_state_dict

    from .models import lora

    saver = getattr(diffusers.loaders, _DIFFUSERS_LORA_SAVERS[family])
    weights = get_peft_model_state_dict(transformer, adapter_name=lora.TRAINED, save_embedding_layers=False)
    weights = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    saver.save_lora_weights(
        save_directory=str(directory),
        transformer_lora_layers=weights,
        transformer_lora_adapter_metadata=_adapter_config(transformer).to_dict(),
        weight_name=DIFFUSERS_WEIGHTS,
    )


def _fsync_tree(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as f:
            os.fsync(f.fileno())
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def export_adapter(checkpoint: str | Path, out: str | Path, fmt: str = "peft") -> Path:
    """Write the trained adapter of `checkpoint` to the directory `out` in format `fmt`; returns `out`.

    `fmt` is "peft" (PeftModel.from_pretrained) or "diffusers" (load_lora_weights; sd3, ltx2 and minimax_h3).
    Raises ExportError (a ConfigError) for an unknown format, a family without that format or an
    `out` that is a file or a non-empty directory, and CheckpointError for a path that is not a
    complete checkpoint, a checkpoint of another base (fingerprint) or one whose recorded model or
    adapter tensors are refused. objects.pt (a pickle) is never read.
    """
    _check_format(fmt)
    out = Path(out)
    _check_output(out)
    transformer, cfg, provenance = _trained_transformer(checkpoint, fmt)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        if fmt == "peft":
            _write_peft(transformer, tmp)
        else:
            _write_diffusers(transformer, cfg.family, tmp)
        provenance["format"] = fmt
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1), encoding="utf-8")
        _fsync_tree(tmp)
        _check_output(out)  # someone may have written there while the model was being built
        try:
            os.replace(tmp, out)  # an empty directory is replaced atomically
        except OSError as e:
            raise ExportError(
                f"could not move the export into {out} ({e}); it must be absent or empty"
            ) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def load_instructions(out: Path, fmt: str) -> list[str]:
    """Python lines that load an export written by export_adapter."""
    if fmt == "peft":
        return [f"peft.PeftModel.from_pretrained(base_transformer, {str(out)!r})"]
    return [
        f"pipeline.load_lora_weights({str(out)!r})",
        f"pipeline.transformer.load_lora_adapter({str(out)!r}, weight_name={DIFFUSERS_WEIGHTS!r})",
    ]


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of `odrl export CHECKPOINT OUT [--format peft|diffusers]`."""
    if parser.description is None:
        parser.description = (
            "Write the trained LoRA adapter of a checkpoint (not the 'old' sampling adapter) in a format "
            "other tools load: peft (adapter_config.json + adapter_model.safetensors, for "
            "PeftModel.from_pretrained on the base transformer) or diffusers (pytorch_lora_weights."
            "safetensors, for pipeline.load_lora_weights; sd3, ltx2, minimax_h3). The base model named in "
            "the checkpoint's config must be available; OUT must be absent or empty."
        )
    parser.add_argument(
        "checkpoint", help="checkpoint directory (step_*), or a run's checkpoints/ folder (its latest)"
    )
    parser.add_argument("out", type=Path, help="output directory (must not exist or be empty)")
    parser.add_argument(
        "--format", dest="format", default="peft", choices=FORMATS, help="output format (default: peft)"
    )


def run_export(args: argparse.Namespace) -> int:
    """`odrl export`: export, then print the written directory and how to load it (and a JSON line)."""
    out = export_adapter(args.checkpoint, args.out, args.format)
    lines = load_instructions(out, args.format)
    print(f"wrote the trained adapter ({args.format}) to {out}")
    print("load it with: " + "  or  ".join(lines))
    print(json.dumps({"output": str(out), "format": args.format, "load_with": lines}), flush=True)
    return 0
