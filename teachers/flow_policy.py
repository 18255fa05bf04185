"""A teacher from any model family's policy (models/families.py): the shipped tiny teacher by
default, a larger diffusers transformer (SD3, Stable Audio, LTX-2, H3) for a smaller student of the
same family, or a training checkpoint's trained adapter; optional classifier-free guidance."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from omni_diffusion_rl.algorithms.guidance import guided_velocity
from omni_diffusion_rl.config import ConfigError, ModelConfig
from omni_diffusion_rl.registry import teachers
from omni_diffusion_rl.teacher import CONVENTION, TeacherInfo, latent_layout


@teachers.register("policy")
class FlowPolicyTeacher:
    """family / pretrained: the model (default the tiny teacher, `odrl pretrain --teacher`);
    checkpoint: a training checkpoint whose trained adapter is used instead (its own model config);
    cfg_scale: classifier-free guidance, v = v(empty) + s (v(prompt) - v(empty)) (1: off; default
    the model folder's recommended one, its guidance.json: 3 for builtin-teacher, else 1);
    device: where it runs; options: the family's model.options."""

    def __init__(
        self,
        family: str = "tiny_av",
        pretrained: str = "builtin-teacher",
        checkpoint: str | None = None,
        cfg_scale: float | None = None,
        device: str = "cpu",
        options: dict[str, Any] | None = None,
    ) -> None:
        from omni_diffusion_rl.inference import load_policy
        from omni_diffusion_rl.models import build_policy, left_in_place

        if cfg_scale is None:
            cfg_scale = default_guidance(family, pretrained, checkpoint)
        _check_options(cfg_scale, device, options)
        if checkpoint is not None:
            self.policy = load_policy(checkpoint)
            source = {"checkpoint_adapters": _adapter_digest(Path(checkpoint))}
            self.family = str(getattr(self.policy, "family", type(self.policy.transformer).__name__))
        else:
            self.family = family
            model = ModelConfig(family=family, pretrained=pretrained, options=dict(options or {}))
            self.policy, _ = build_policy(model)
            source = {
                k: v for k, v in dataclasses.asdict(model).items() if k in ("family", "pretrained", "options")
            }
        move = getattr(self.policy, "to", None)
        if callable(move):  # the transformer goes to the device on first use, unless shard() splits it
            with left_in_place(self.policy.transformer):
                move(device)
        self.policy.transformer.requires_grad_(False).eval()
        self.device, self.cfg_scale = torch.device(device), float(cfg_scale)
        self._placed = False  # the transformer: on self.device (first use), or split by shard()
        if self.cfg_scale != 1.0:
            try:
                self.policy.encode_prompts([""])
            except ValueError as e:
                raise ConfigError(
                    f"teacher 'policy': cfg_scale={cfg_scale} needs the empty prompt, which {family} refuses "
                    f"({e}); use cfg_scale 1"
                ) from e
        self._info = TeacherInfo(
            latent_shape=tuple(self.policy.latent_shape),
            layout=latent_layout(self.policy),
            convention=CONVENTION,
            fingerprint=_fingerprint(self.policy.transformer, {**source, "cfg_scale": self.cfg_scale}),
            trained_parts=trained_parts(family, pretrained, checkpoint),
        )

    def info(self) -> TeacherInfo:
        return self._info

    def shard(self, sharder: Any) -> None:
        """Split the frozen transformer over the training processes (sharding.Sharder), forward only,
        straight from host memory: each process's part goes to its own device, which the teacher
        then runs on (the trainers' kind of device is required)."""
        if not sharder.active or self._placed:
            return
        if self.device.type != sharder.device.type:
            raise ConfigError(
                f"teacher 'policy' runs on {self.device} but the training processes shard on "
                f"{sharder.device.type}: set teacher.options.device={sharder.device.type}"
            )
        sharder.teacher(self.policy.transformer, self.family)
        fixed_calls = getattr(self.policy, "use_sharded_transformer", None)
        if callable(fixed_calls):  # the same transformer calls on every process (MiniMax-H3)
            fixed_calls()
        self.device, self._placed = sharder.device, True

    @torch.no_grad()
    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        if not self._placed:
            self.policy.transformer.to(self.device)
            self._placed = True
        x_t, t = x_t.to(self.device), t.to(self.device)
        cond = {k: v.to(self.device) for k, v in self.policy.encode_prompts(list(prompts)).items()}
        v = self.policy.velocity(x_t, t, cond).float()
        if self.cfg_scale != 1.0:
            empty = {k: v.to(self.device) for k, v in self.policy.encode_prompts([""] * len(prompts)).items()}
            v_empty = self.policy.velocity(x_t, t, empty).float()
            v = guided_velocity(v, v_empty, self.cfg_scale)
        return v.cpu()


def model_folder_of(family: str, pretrained: str, checkpoint: str | None) -> Path | None:
    """The local folder of a teacher's model, or None (a checkpoint's adapter, a hub id)."""
    from omni_diffusion_rl.models.tiny_av import model_folder

    if checkpoint is not None:
        return None
    folder = model_folder(pretrained) if family == "tiny_av" else Path(pretrained)
    return folder if folder.is_dir() else None


def default_guidance(family: str, pretrained: str, checkpoint: str | None) -> float:
    """The guidance of a teacher given none: what its model folder recommends (guidance.json, which
    `odrl pretrain` writes for a model trained with prompt dropout; the shipped teacher's is 3), else
    off. A checkpoint's adapter, a hub id or a folder without the file: off."""
    from omni_diffusion_rl.models.folder_card import FolderCardError, read_folder_guidance

    folder = model_folder_of(family, pretrained, checkpoint)
    try:
        recommended = None if folder is None else read_folder_guidance(folder)
    except FolderCardError as e:
        raise ConfigError(f"teacher 'policy': {e} (or give teacher.options.cfg_scale)") from e
    return 1.0 if recommended is None else recommended


def trained_parts(family: str, pretrained: str, checkpoint: str | None) -> tuple[str, ...] | None:
    """The latent parts a teacher's model was trained on (trained_parts.json), None for all."""
    from omni_diffusion_rl.models.folder_card import FolderCardError, read_trained_parts

    folder = model_folder_of(family, pretrained, checkpoint)
    try:
        return None if folder is None else read_trained_parts(folder)
    except FolderCardError as e:
        raise ConfigError(f"teacher 'policy': {e}") from e


def _check_options(cfg_scale: Any, device: Any, options: Any) -> None:
    """The teacher's options as a ConfigError sentence (teacher.options, or serve-teacher --options)."""
    where = "teacher 'policy' (teacher.options or serve-teacher --options)"
    if isinstance(cfg_scale, bool) or not isinstance(cfg_scale, (int, float)) or not cfg_scale >= 1.0:
        raise ConfigError(f"{where}: cfg_scale must be a number >= 1 (1 is off); got {cfg_scale!r}")
    if options is not None and not isinstance(options, dict):
        raise ConfigError(
            f"{where}: options must be a mapping of the family's model.options; got {options!r}"
        )
    try:
        kind = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"{where}: device {device!r} is not a device, e.g. cpu or cuda:0 ({e})") from e
    if kind.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{where}: device {device!r} but no CUDA device is visible here; use device cpu")


def _adapter_digest(checkpoint: Path) -> str:
    """What a checkpoint's adapters are, by content: the sha256 its manifest records for its tensor
    file (verified when load_policy read it), so copies at other paths agree and a retrained run
    differs."""
    from omni_diffusion_rl.checkpoint import MAX_MANIFEST_BYTES, read_json, resolve_checkpoint

    manifest = read_json(resolve_checkpoint(checkpoint) / "manifest.json", MAX_MANIFEST_BYTES)
    return str(manifest["files"]["tensors.safetensors"]["sha256"])


def _fingerprint(transformer: torch.nn.Module, source: dict[str, Any]) -> str:
    """A hash of the source, the transformer's config and a sample of its weights."""
    digest = hashlib.sha256(json.dumps(source, sort_keys=True, default=str).encode())
    config = dict(transformer.config) if hasattr(transformer, "config") else {}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, param in sorted(transformer.state_dict().items())[:64]:
        digest.update(name.encode())
        digest.update(param.detach().float().flatten()[:256].cpu().numpy().tobytes())
    return digest.hexdigest()[:16]
