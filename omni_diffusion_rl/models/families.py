"""The built-in model families, registered by name for `model.family` (also listed as entry points
in pyproject.toml, so a config is checked without importing them). A family's loader takes the
model config and returns the policy and its default LoRA target modules; register your own with
`@omni_diffusion_rl.registry.models.register("name")` or the entry-point group
`omni_diffusion_rl.models`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import ConfigError
from ..precision import BASE_DTYPES
from ..registry import models

if TYPE_CHECKING:
    from ..config import ModelConfig
    from .policy import FlowPolicy


def _has_local(source: str, subfolder: str) -> bool:
    return (Path(source) / subfolder).is_dir()


@models.register("tiny_av")
def load_tiny_av(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """The built-in tiny text-to-audio-video model ('builtin' or a saved directory)."""
    from .tiny_av import DEFAULT_LORA_TARGETS, TinyAVPolicy

    check_family_options("tiny_av", cfg.options)
    return TinyAVPolicy.from_pretrained(cfg.pretrained), list(DEFAULT_LORA_TARGETS)


@models.register("tiny_sync")
def load_tiny_sync(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """The built-in tiny sync model ('builtin' or a saved directory), for the tiny sync world."""
    from .tiny_av import DEFAULT_LORA_TARGETS
    from .tiny_sync import TinySyncPolicy

    check_family_options("tiny_sync", cfg.options)
    return TinySyncPolicy.from_pretrained(cfg.pretrained), list(DEFAULT_LORA_TARGETS)


def _load_diffusers(cfg: ModelConfig, image: bool) -> tuple[FlowPolicy, list[str]]:
    """A diffusers pipeline directory (or hub id) with a `transformer` subfolder; a `vae` subfolder
    decodes latents when present, and for images a `text_encoder` (+ `tokenizer`) subfolder encodes
    prompts (otherwise prompts are hashed offline)."""
    from .diffusers_adapter import DiffusersAudioPolicy, DiffusersImagePolicy, TransformersPromptEncoder

    check_family_options("sd3" if image else "stable_audio", cfg.options)
    cls = DiffusersImagePolicy if image else DiffusersAudioPolicy
    is_local = Path(cfg.pretrained).exists()
    vae = "vae" if not is_local or _has_local(cfg.pretrained, "vae") else None
    policy = cls.from_pretrained(cfg.pretrained, vae_subfolder=vae)
    if image and is_local and _has_local(cfg.pretrained, "text_encoder"):
        config = policy.transformer.config
        policy.prompt_encoder = TransformersPromptEncoder.from_pretrained(
            cfg.pretrained, hidden_dim=config.joint_attention_dim, pooled_dim=config.pooled_projection_dim
        )
    return policy, list(policy.lora_target_modules)


NO_OPTIONS = (
    "tiny_av",
    "tiny_sync",
    "tiny_omni",
    "sd3",
    "stable_audio",
)  # built-in families that take no model.options


def check_family_options(family: str, options: dict) -> None:
    """model.options against the family's policy constructor (ltx2, minimax_h3) or its option names
    (qwen2_5_omni, qwen3_omni); a ConfigError names the unknown keys. The built-in families without
    options (NO_OPTIONS) refuse any; a registered family reads its own."""
    if family == "ltx2":
        from .ltx2 import LTX2Policy as policy_class
    elif family == "minimax_h3":
        from .minimax_h3 import MiniMaxH3Policy as policy_class
    elif family in ("qwen2_5_omni", "qwen3_omni"):
        from .qwen_omni import OPTIONS

        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise ConfigError(
                f"model.options: {', '.join(unknown)} unknown to {family}; it takes {', '.join(OPTIONS)}"
            )
        return
    elif family in NO_OPTIONS:
        if options:
            raise ConfigError(
                f"model.options: {', '.join(sorted(map(str, options)))} unknown to {family}, which takes no "
                "options; leave model.options empty"
            )
        return
    else:
        return
    _check_options(family, policy_class, options)


def _check_options(family: str, cls: type, options: dict) -> None:
    """model.options names only parameters of the policy's constructor (after its components)."""
    import inspect

    skip = {"self", "pipeline", "components"}
    allowed = [n for n in inspect.signature(cls.__init__).parameters if n not in skip]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ConfigError(
            f"model.options: {', '.join(unknown)} unknown to {family}; it takes {', '.join(allowed)}"
        )


@models.register("tiny_omni")
def load_tiny_omni(cfg: ModelConfig) -> tuple[Any, list[str]]:
    """The tiny omni language model ('builtin-omni', the shipped base, or a saved directory): GSPO's
    answering policy on tiny AVQA."""
    from .tiny_omni import TinyOmniPolicy

    check_family_options("tiny_omni", cfg.options)
    pretrained = "builtin-omni" if cfg.pretrained == "builtin" else cfg.pretrained
    policy = TinyOmniPolicy.from_pretrained(pretrained)
    return policy, list(policy.lora_targets)


@models.register("qwen2_5_omni")
def load_qwen2_5_omni(cfg: ModelConfig) -> tuple[Any, list[str]]:
    """Qwen2.5-Omni's thinker (text out) as GSPO's answering policy (models/qwen_omni.py): a folder
    or hub id with the thinker, its tokenizer and preprocessor_config.json; model.options sets the
    clip (fps, seconds, frame_size); model.base_dtype the thinker's weights. LoRA goes on the
    language model's projections only. Its held-out evaluation is evaluation/avqa.py's, registered
    there."""
    from .qwen_omni import QwenOmniPolicy

    check_family_options("qwen2_5_omni", cfg.options)
    policy = QwenOmniPolicy.from_pretrained(cfg.pretrained, dtype=BASE_DTYPES[cfg.base_dtype], **cfg.options)
    return policy, list(policy.lora_targets)


@models.register("qwen3_omni")
def load_qwen3_omni(cfg: ModelConfig) -> tuple[Any, list[str]]:
    """Qwen3-Omni-MoE's thinker (text out) as GSPO's answering policy, read as qwen2_5_omni's
    (models/qwen_omni.py, Qwen3OmniModel): the same folder layout and model.options. LoRA goes on
    the language model's attention projections only (not the MoE experts). Its held-out evaluation
    is evaluation/avqa.py's, registered there."""
    from .qwen_omni import Qwen3OmniPolicy

    check_family_options("qwen3_omni", cfg.options)
    policy = Qwen3OmniPolicy.from_pretrained(cfg.pretrained, dtype=BASE_DTYPES[cfg.base_dtype], **cfg.options)
    return policy, list(policy.lora_targets)


@models.register("ltx2")
def load_ltx2(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """LTX-2 (text to joint audio and video) through LTX2Pipeline's components (models/ltx2.py): a
    saved pipeline directory or hub id; model.options sets the clip size."""
    from .ltx2 import LTX2Policy

    check_family_options("ltx2", cfg.options)
    policy = LTX2Policy.from_pretrained(cfg.pretrained, dtype=BASE_DTYPES[cfg.base_dtype], **cfg.options)
    return policy, list(policy.lora_target_modules)


@models.register("minimax_h3")
def load_minimax_h3(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """MiniMax-H3 (text to joint audio and video) over diffusers' H3 transformer and VAEs with our
    own sequence packing (models/minimax_h3.py): a directory (or hub id) of component folders;
    model.options sets the clip size."""
    from .minimax_h3 import MiniMaxH3Policy

    check_family_options("minimax_h3", cfg.options)
    policy = MiniMaxH3Policy.from_pretrained(cfg.pretrained, dtype=BASE_DTYPES[cfg.base_dtype], **cfg.options)
    return policy, list(policy.lora_target_modules)


@models.register("sd3")
def load_sd3(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """Stable Diffusion 3 (text to image) through diffusers."""
    return _load_diffusers(cfg, image=True)


@models.register("stable_audio")
def load_stable_audio(cfg: ModelConfig) -> tuple[FlowPolicy, list[str]]:
    """Stable Audio (text to audio) through diffusers."""
    return _load_diffusers(cfg, image=False)
