"""FlowPolicy adapters over diffusers transformers: SD3 (images) and Stable Audio DiT (audio).

Both follow the project convention x_t = (1 - t) x0 + t eps with velocity v = eps - x0. Prompts are
turned into a `Condition` by a `PromptEncoder`: `HashedPromptEncoder` (offline, deterministic, for
tests and CPU smoke runs) or `TransformersPromptEncoder` (a real local `transformers` text encoder).
Every prompt encoder returns the same two keys, `encoder_hidden_states` [B, L, D] and `pooled` [B, P];
each policy maps them onto its transformer's inputs.

Both policies sample (and train) on diffusers' FlowMatchEulerDiscreteScheduler time grid
(`time_grid`), not the project's uniform one.
"""

from __future__ import annotations

import os
import re
import warnings
import zlib
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from ..experience.sampling import check_flow_match_config, flow_match_time_grid
from ..media import MediaBatch
from ..runtime.sharding import compute_device
from .policy import Condition

HIDDEN_KEY = "encoder_hidden_states"
POOLED_KEY = "pooled"

SD3_LORA_TARGETS: list[str] = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "ff.net.0.proj",
    "ff.net.2",
    "ff_context.net.0.proj",
    "ff_context.net.2",
]
"""Joint-attention projections (image and text streams) and both streams' feed-forward layers."""

STABLE_AUDIO_LORA_TARGETS: list[str] = ["to_q", "to_k", "to_v", "to_out.0"]
"""Self- (attn1) and cross-attention (attn2) projections of every Stable Audio DiT block."""

_PolicyT = TypeVar("_PolicyT", bound="_DiffusersPolicy")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


# --------------------------------------------------------------------------------------------------
# Loading helpers
# --------------------------------------------------------------------------------------------------


def _offline() -> bool:
    """Whether HF_HUB_OFFLINE is set now (read at call time, not at import time)."""
    return os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _resolve_source(path_or_hub_id: str | os.PathLike[str], subfolder: str | None, what: str) -> str:
    """A local directory or a hub id to load `what` from; a missing local path raises at once.

    Strings that are not an existing directory and do not look like `org/name` are taken as local
    paths, so a typo fails here with FileNotFoundError instead of becoming a hub download attempt.
    """
    source = os.path.expanduser(os.fspath(path_or_hub_id))
    if os.path.isdir(source):
        if subfolder and not os.path.isdir(os.path.join(source, subfolder)):
            raise FileNotFoundError(
                f"cannot load the {what}: local directory '{source}' has no subfolder '{subfolder}'"
                " (pass the right subfolder, or subfolder=None if it sits at the top level)"
            )
        return source
    if os.path.exists(source):
        raise NotADirectoryError(f"cannot load the {what}: '{source}' is a file, expected a model directory")
    if os.path.isabs(source) or source.startswith((".", "~")) or not _HUB_ID.match(source):
        raise FileNotFoundError(
            f"cannot load the {what}: local path '{source}' does not exist (and is not a hub id 'org/name')"
        )
    return source


def _load_kwargs(subfolder: str | None, local_files_only: bool | None, **extra: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {k: v for k, v in extra.items() if v is not None}
    if subfolder:
        kwargs["subfolder"] = subfolder
    kwargs["local_files_only"] = _offline() if local_files_only is None else local_files_only
    return kwargs


def _load(loader: Any, source: str, what: str, kwargs: dict[str, Any]) -> Any:
    """`loader.from_pretrained(source, **kwargs)`; a hub failure names the id and the offline mode."""
    try:
        return loader.from_pretrained(source, **kwargs)
    except OSError as err:
        if os.path.isdir(source):
            raise
        mode = "the local cache only (offline)" if kwargs.get("local_files_only") else "the Hugging Face hub"
        raise OSError(
            f"cannot load the {what} '{source}' (subfolder {kwargs.get('subfolder')!r}) from {mode}: {err}"
        ) from err


def _module_device_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a module computes (sharding.compute_device: a sharded one's mesh device) and its dtype."""
    return compute_device(module), next(module.parameters()).dtype


# --------------------------------------------------------------------------------------------------
# Prompt encoders
# --------------------------------------------------------------------------------------------------


@runtime_checkable
class PromptEncoder(Protocol):
    """Maps prompts to a Condition with `encoder_hidden_states` [B, L, D] and `pooled` [B, P]."""

    def __call__(self, prompts: list[str]) -> Condition: ...


class HashedPromptEncoder:
    """Deterministic offline text features: hashed words looked up in a fixed random table.

    Each word (lower-cased `\\w+` run) is hashed with zlib.crc32 into `vocab_size` buckets. The
    token features are the bucket's row of a seeded random table plus a positional row; sequences
    are zero-padded to `max_tokens`. The pooled vector is the mean of the words' rows in a second
    table (zeros for an empty prompt). Same seed, same features, in every process.
    """

    def __init__(
        self, dim: int, pooled_dim: int, max_tokens: int = 16, seed: int = 0, vocab_size: int = 4096
    ):
        if min(dim, pooled_dim, max_tokens, vocab_size) < 1:
            raise ValueError("dim, pooled_dim, max_tokens and vocab_size must all be positive")
        self.dim = dim
        self.pooled_dim = pooled_dim
        self.max_tokens = max_tokens
        self.vocab_size = vocab_size
        gen = torch.Generator().manual_seed(seed)
        self.token_table = torch.randn(vocab_size, dim, generator=gen)
        self.position_table = 0.1 * torch.randn(max_tokens, dim, generator=gen)
        self.pooled_table = torch.randn(vocab_size, pooled_dim, generator=gen)

    def token_ids(self, prompt: str) -> list[int]:
        """Hash buckets of the prompt's first `max_tokens` words."""
        words = re.findall(r"\w+", prompt.lower())[: self.max_tokens]
        return [zlib.crc32(w.encode("utf-8")) % self.vocab_size for w in words]

    def __call__(self, prompts: list[str]) -> Condition:
        hidden = torch.zeros(len(prompts), self.max_tokens, self.dim)
        pooled = torch.zeros(len(prompts), self.pooled_dim)
        for row, prompt in enumerate(prompts):
            ids = torch.tensor(self.token_ids(prompt), dtype=torch.long)
            if len(ids) == 0:
                continue
            hidden[row, : len(ids)] = self.token_table[ids] + self.position_table[: len(ids)]
            pooled[row] = self.pooled_table[ids].mean(dim=0)
        return {HIDDEN_KEY: hidden, POOLED_KEY: pooled}


def _check_tokenizer(tokenizer: Any, source: str) -> None:
    """Raise if the tokenizer knows nothing but its special tokens (a silently empty load)."""
    vocab = tokenizer.get_vocab()
    specials = set(getattr(tokenizer, "all_special_tokens", []))
    if not set(vocab) - specials:
        raise ValueError(
            f"tokenizer loaded from '{source}' has an empty vocabulary"
            f" (only the special tokens {sorted(specials)});"
            " the files were probably not found (e.g. offline with an uncached hub id): point to a local"
            " directory holding tokenizer files"
        )


class TransformersPromptEncoder:
    """A local `transformers` text encoder and tokenizer as a PromptEncoder (the real-model path).

    Prompts are padded/truncated to `max_tokens` and encoded without gradients.

    - `encoder_hidden_states` is the encoder's `last_hidden_state` [B, max_tokens, D]. With
      `mask_padding`, padded positions are zeroed (Stable Audio's T5 convention).
    - `pooled` [B, P] depends on `pooling`: "projection" takes the output's `text_embeds` (for
      CLIPTextModelWithProjection the projected end-of-text token, as SD3 does); "pooler" takes
      `pooler_output` (CLIP: the un-projected end-of-text token); "mean" averages `last_hidden_state`
      over real (unpadded) tokens. "auto" picks the first of these the output provides.
    - `hidden_dim` / `pooled_dim` zero-pad the features up to the transformer's widths (SD3 pads its
      CLIP features to the T5 width the same way); a narrower target raises.

    One encoder reproduces neither SD3's three-encoder conditioning (CLIP-L + CLIP-G + T5) nor Stable
    Audio's duration embeddings; it gives a faithful single-encoder path to fine-tune from.
    """

    POOLINGS = ("auto", "projection", "pooler", "mean")

    def __init__(
        self,
        text_encoder: nn.Module,
        tokenizer: Any,
        max_tokens: int = 77,
        pooling: str = "auto",
        hidden_dim: int | None = None,
        pooled_dim: int | None = None,
        mask_padding: bool = False,
    ):
        if pooling not in self.POOLINGS:
            raise ValueError(f"pooling must be one of {self.POOLINGS}; got '{pooling}'")
        _check_tokenizer(tokenizer, getattr(tokenizer, "name_or_path", "<given tokenizer>"))
        self.text_encoder = text_encoder.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.pooling = pooling
        self.hidden_dim = hidden_dim
        self.pooled_dim = pooled_dim
        self.mask_padding = mask_padding

    @classmethod
    def from_pretrained(
        cls,
        path_or_hub_id: str | os.PathLike[str],
        subfolder: str | None = "text_encoder",
        tokenizer_subfolder: str | None = "tokenizer",
        model_cls: type | None = None,
        tokenizer_cls: type | None = None,
        torch_dtype: torch.dtype | None = None,
        local_files_only: bool | None = None,
        **encoder_kwargs: Any,
    ) -> TransformersPromptEncoder:
        """Load tokenizer and text encoder (e.g. from a diffusers pipeline directory).

        `model_cls` defaults to the class named in the encoder's config `architectures` (so a saved
        CLIPTextModelWithProjection or T5EncoderModel comes back as itself), else AutoModel.
        `tokenizer_cls` defaults to AutoTokenizer. `encoder_kwargs` go to the constructor.
        """
        import transformers

        tok_source = _resolve_source(path_or_hub_id, tokenizer_subfolder, "tokenizer")
        tok_cls = tokenizer_cls or transformers.AutoTokenizer
        tok_kwargs = _load_kwargs(tokenizer_subfolder, local_files_only)
        tokenizer = _load(tok_cls, tok_source, "tokenizer", tok_kwargs)
        _check_tokenizer(tokenizer, tok_source)

        source = _resolve_source(path_or_hub_id, subfolder, "text encoder")
        kwargs = _load_kwargs(subfolder, local_files_only)
        if model_cls is None:
            config = _load(transformers.AutoConfig, source, "text encoder config", kwargs)
            names = getattr(config, "architectures", None) or []
            model_cls = getattr(transformers, names[0], None) if names else None
            model_cls = model_cls or transformers.AutoModel
        if torch_dtype is not None:
            kwargs["dtype"] = torch_dtype
        model = _load(model_cls, source, "text encoder", kwargs)
        return cls(model, tokenizer, **encoder_kwargs)

    def _pool(self, out: Any, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        order = ["projection", "pooler", "mean"] if self.pooling == "auto" else [self.pooling]
        for kind in order:
            if kind == "projection" and getattr(out, "text_embeds", None) is not None:
                return out.text_embeds
            if kind == "pooler" and getattr(out, "pooler_output", None) is not None:
                return out.pooler_output
            if kind == "mean":
                weights = mask.to(hidden.dtype).unsqueeze(-1)
                return (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp_min(1.0)
        raise ValueError(f"pooling='{self.pooling}' but the text encoder output has no such field")

    @staticmethod
    def _pad(x: torch.Tensor, width: int | None, name: str) -> torch.Tensor:
        if width is None or width == x.shape[-1]:
            return x
        if width < x.shape[-1]:
            raise ValueError(f"{name} of the text encoder is {x.shape[-1]} wide, above the target {width}")
        return nn.functional.pad(x, (0, width - x.shape[-1]))

    @torch.no_grad()
    def __call__(self, prompts: list[str]) -> Condition:
        tokens = self.tokenizer(
            list(prompts),
            padding="max_length",
            max_length=self.max_tokens,
            truncation=True,
            return_tensors="pt",
        )
        device, _ = _module_device_dtype(self.text_encoder)
        ids = tokens["input_ids"].to(device)
        mask = tokens["attention_mask"].to(device)
        out = self.text_encoder(input_ids=ids, attention_mask=mask)
        hidden = out.last_hidden_state
        pooled = self._pool(out, hidden, mask)
        if self.mask_padding:
            hidden = hidden * mask.unsqueeze(-1).to(hidden.dtype)
        return {
            HIDDEN_KEY: self._pad(hidden, self.hidden_dim, "last_hidden_state"),
            POOLED_KEY: self._pad(pooled, self.pooled_dim, "the pooled vector"),
        }


# --------------------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------------------


class _DiffusersPolicy:
    """Shared plumbing: prompt encoding, device/dtype moves, VAE latent unscaling, loading, time grid.

    `scheduler_config` is a FlowMatchEulerDiscreteScheduler config (e.g. a pipeline's
    `scheduler/scheduler_config.json`), or None for that scheduler's defaults. Only its
    `num_train_timesteps` is used, by `time_grid`; options that change the scheduler's sigmas
    (dynamic shifting, karras / exponential / beta sigmas, ...) raise ValueError here.
    """

    lora_target_modules: ClassVar[list[str]] = []
    _transformer_class: ClassVar[str] = ""
    _vae_class: ClassVar[str] = ""
    _scheduler_class: ClassVar[str | None] = None  # the pipeline scheduler whose config from_pretrained reads
    _hidden_width_key: ClassVar[str] = ""
    _pooled_width_key: ClassVar[str] = ""

    def __init__(
        self,
        transformer: nn.Module,
        vae: nn.Module | None,
        prompt_encoder: PromptEncoder | None,
        scheduler_config: Mapping[str, Any] | None = None,
    ):
        self.scheduler_config: dict[str, Any] = dict(scheduler_config or {})
        self.num_train_timesteps = check_flow_match_config(self.scheduler_config)
        self.transformer = transformer
        self.vae = vae
        if vae is not None:
            vae.requires_grad_(False)
        config = transformer.config
        self.hidden_width = int(config[self._hidden_width_key])
        self.pooled_width = int(config[self._pooled_width_key])
        self.prompt_encoder: PromptEncoder = prompt_encoder or HashedPromptEncoder(
            self.hidden_width, self.pooled_width
        )

    def time_grid(self, num_steps: int, shift: float) -> torch.Tensor:
        """The FlowMatchEulerDiscreteScheduler grid (`sampling.flow_match_time_grid`) for `shift`.

        These are the sigmas an SD3 pipeline samples with, shift(linspace(1, shift(1 / T), N)) then 0
        (T = the scheduler config's num_train_timesteps), so rollouts and training see the noise
        levels the model is usually sampled on, down to shift(shift(1 / T)) (0.009 for shift 3). `shift`
        (the config's `sampling.time_shift`) is applied wherever the scheduler applies its own
        `shift`, i.e. the grid is that of FlowMatchEulerDiscreteScheduler(shift=shift); a different
        `shift` in the scheduler config is overridden (with a warning).
        """
        config_shift = self.scheduler_config.get("shift")
        if config_shift is not None and float(config_shift) != float(shift):
            warnings.warn(
                f"sampling shift {shift} differs from the scheduler config's shift {config_shift};"
                f" sampling with {shift}",
                stacklevel=2,
            )
        return flow_match_time_grid(num_steps, shift, self.num_train_timesteps)

    def to(
        self: _PolicyT, device: torch.device | str | None = None, dtype: torch.dtype | None = None
    ) -> _PolicyT:
        """Move the transformer and the VAE (in place); returns self."""
        for module in (self.transformer, self.vae):
            if module is not None:
                module.to(device=device, dtype=dtype)
        return self

    def encode_prompts(self, prompts: list[str]) -> Condition:
        """The prompt encoder's features, width-checked and moved to the transformer's device/dtype."""
        cond = self.prompt_encoder(list(prompts))
        for key, width in ((HIDDEN_KEY, self.hidden_width), (POOLED_KEY, self.pooled_width)):
            if key not in cond:
                raise KeyError(f"prompt encoder output lacks '{key}'; it has {sorted(cond)}")
            if cond[key].shape[-1] != width:
                raise ValueError(
                    f"prompt encoder gives '{key}' of width {cond[key].shape[-1]}, but the transformer"
                    f" expects {width}; build the encoder with matching dims (or pad it)"
                )
        device, dtype = _module_device_dtype(self.transformer)
        return {
            k: v.to(device=device, dtype=dtype if v.is_floating_point() else v.dtype) for k, v in cond.items()
        }

    def _timesteps(self, t: torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
        t = torch.as_tensor(t, device=device, dtype=torch.float32)
        return t.expand(batch) if t.ndim == 0 else t.reshape(batch)

    def _vae_input(self, x0: torch.Tensor) -> torch.Tensor:
        """Undo the VAE's latent normalization: x / scaling_factor + shift_factor."""
        assert self.vae is not None
        config = self.vae.config
        scale = getattr(config, "scaling_factor", None)
        shift = getattr(config, "shift_factor", None)
        x = x0 / scale if scale else x0
        x = x + shift if shift else x
        device, dtype = _module_device_dtype(self.vae)
        return x.to(device=device, dtype=dtype)

    @classmethod
    def from_pretrained(
        cls: type[_PolicyT],
        path_or_hub_id: str | os.PathLike[str],
        subfolder: str | None = "transformer",
        vae_subfolder: str | None = "vae",
        prompt_encoder: PromptEncoder | None = None,
        torch_dtype: torch.dtype | None = None,
        local_files_only: bool | None = None,
        policy_kwargs: dict[str, Any] | None = None,
        scheduler_subfolder: str | None = "scheduler",
        **load_kwargs: Any,
    ) -> _PolicyT:
        """Load the transformer (and the VAE unless `vae_subfolder` is None) with diffusers.

        `path_or_hub_id` is a local directory (a full pipeline or a bare model with subfolder=None) or
        a hub id. A missing local path raises FileNotFoundError without touching the hub; with
        HF_HUB_OFFLINE=1 hub ids resolve from the local cache only. `load_kwargs` (revision, variant,
        ...) go to both diffusers `from_pretrained` calls; `policy_kwargs` to the policy constructor.
        For the image policy the pipeline's scheduler config (`scheduler_subfolder`) is read when it
        can be found, for `time_grid`; when it cannot, the scheduler's defaults are used.
        """
        import diffusers

        transformer_cls = getattr(diffusers, cls._transformer_class)
        source = _resolve_source(path_or_hub_id, subfolder, cls._transformer_class)
        kwargs = _load_kwargs(subfolder, local_files_only, torch_dtype=torch_dtype, **load_kwargs)
        transformer = _load(transformer_cls, source, cls._transformer_class, kwargs)
        vae = None
        if vae_subfolder is not None:
            vae_cls = getattr(diffusers, cls._vae_class)
            vae_source = _resolve_source(path_or_hub_id, vae_subfolder, f"{cls._vae_class} (vae_subfolder)")
            vae_kwargs = _load_kwargs(vae_subfolder, local_files_only, torch_dtype=torch_dtype, **load_kwargs)
            vae = _load(vae_cls, vae_source, cls._vae_class, vae_kwargs)
        policy_kwargs = dict(policy_kwargs or {})
        if "scheduler_config" not in policy_kwargs and scheduler_subfolder is not None:
            revision = load_kwargs.get("revision")
            policy_kwargs["scheduler_config"] = cls._load_scheduler_config(
                source, scheduler_subfolder, kwargs["local_files_only"], revision
            )
        return cls(transformer, vae=vae, prompt_encoder=prompt_encoder, **policy_kwargs)

    @classmethod
    def _load_scheduler_config(
        cls, source: str, subfolder: str, local_files_only: bool, revision: str | None
    ) -> dict[str, Any] | None:
        """The pipeline's `_scheduler_class` config, or None when there is none to read.

        None when the class reads no scheduler config, a local directory or the hub / cache has no
        `subfolder/scheduler_config.json`, or the saved scheduler is of another class (with a warning).
        """
        if cls._scheduler_class is None:
            return None
        import diffusers

        loader = getattr(diffusers, cls._scheduler_class)
        if os.path.isdir(source) and not os.path.isfile(os.path.join(source, subfolder, loader.config_name)):
            return None
        try:
            config = loader.load_config(
                source, subfolder=subfolder, local_files_only=local_files_only, revision=revision
            )
        except OSError:
            if os.path.isdir(source):
                raise
            return None
        name = config.get("_class_name", cls._scheduler_class)
        if name != cls._scheduler_class:
            warnings.warn(
                f"'{source}' has a {name} scheduler, not {cls._scheduler_class};"
                f" sampling on the default {cls._scheduler_class} grid",
                stacklevel=3,
            )
            return None
        return dict(config)


class DiffusersImagePolicy(_DiffusersPolicy):
    """FlowPolicy over `diffusers.SD3Transformer2DModel`; latents are [C, H, W].

    velocity() calls the transformer with timestep = 1000 t, which is SD3's own rectified-flow
    convention (sigma = t, prediction eps - x0), so pretrained SD3 / SD3.5 weights are used as trained.
    Condition: `encoder_hidden_states` [B, L, joint_attention_dim] and `pooled`
    [B, pooled_projection_dim] (fed as `pooled_projections`). decode() with an AutoencoderKL undoes its
    scaling/shift factors and maps [-1, 1] pixels to [0, 1]; without a VAE the first three latent
    channels are read as pixels in [-1, 1]. Either way the result is a 1-frame video.
    time_grid() is the SD3 pipelines' FlowMatchEulerDiscreteScheduler grid; from_pretrained reads the
    pipeline's `scheduler` config for it.
    """

    lora_target_modules: ClassVar[list[str]] = SD3_LORA_TARGETS
    _transformer_class = "SD3Transformer2DModel"
    _vae_class = "AutoencoderKL"
    _scheduler_class = "FlowMatchEulerDiscreteScheduler"
    _hidden_width_key = "joint_attention_dim"
    _pooled_width_key = "pooled_projection_dim"

    def __init__(
        self,
        transformer: nn.Module,
        vae: nn.Module | None = None,
        prompt_encoder: PromptEncoder | None = None,
        latent_size: int | tuple[int, int] | None = None,
        fps: float = 8.0,
        scheduler_config: Mapping[str, Any] | None = None,
    ):
        super().__init__(transformer, vae, prompt_encoder, scheduler_config)
        config = transformer.config
        size = config["sample_size"] if latent_size is None else latent_size
        height, width = (size, size) if isinstance(size, int) else size
        patch = config["patch_size"]
        if height % patch or width % patch:
            raise ValueError(f"latent size {height}x{width} is not a multiple of the patch size {patch}")
        self._latent_shape = (int(config["in_channels"]), int(height), int(width))
        self.fps = fps

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self._latent_shape

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        """eps - x0 predicted at (x_t, t); x_t is [B, C, H, W] and t is [B] in [0, 1]."""
        device, dtype = _module_device_dtype(self.transformer)
        timestep = self._timesteps(t, x_t.shape[0], device) * 1000.0
        out = self.transformer(
            hidden_states=x_t.to(device=device, dtype=dtype),
            encoder_hidden_states=cond[HIDDEN_KEY].to(device=device, dtype=dtype),
            pooled_projections=cond[POOLED_KEY].to(device=device, dtype=dtype),
            timestep=timestep.to(dtype),
            return_dict=True,
        ).sample
        return out.to(x_t.dtype)

    def decode(self, x0: torch.Tensor) -> MediaBatch:
        """Pixels in [0, 1] as video [B, 1, 3, H, W]."""
        if self.vae is not None:
            pixels = self.vae.decode(self._vae_input(x0)).sample.float()
        else:
            channels = x0.shape[1]
            pixels = x0[:, [i % channels for i in range(3)]].float()
        video = ((pixels[:, :3] + 1.0) / 2.0).clamp(0.0, 1.0)
        return MediaBatch(video=video.unsqueeze(1), fps=self.fps)


class DiffusersAudioPolicy(_DiffusersPolicy):
    """FlowPolicy over `diffusers.StableAudioDiTModel`; latents are [C, T].

    The transformer gets `hidden_states` [B, C, T], `timestep` = t itself (in [0, 1]),
    `encoder_hidden_states` [B, L, cross_attention_input_dim] for cross-attention,
    `global_hidden_states` = `pooled` as one prepended token [B, 1, global_states_input_dim], and the
    1-D rotary embedding over T + 1 positions that the diffusers pipeline builds.

    Convention caveat: pretrained Stable Audio is a v-prediction model on a cosine schedule (EDM
    preconditioning with sigma_data = 1): it sees x = cos(pi t / 2) x0 + sin(pi t / 2) eps with
    timestep atan(sigma) * 2 / pi = t, and predicts cos(pi t / 2) eps - sin(pi t / 2) x0. Passing
    timestep = t keeps its noise-level axis, but reading its output as the rectified-flow velocity
    eps - x0 at x_t = (1 - t) x0 + t eps changes its convention, so fine-tuning has to re-learn it.
    This adapter's job is the forward / LoRA path, not a conversion of the pretrained schedule.
    Stable Audio's real conditioning (T5 + seconds_start/end embeddings) is also not reproduced.

    Time grid: StableAudioPipeline samples with CosineDPMSolverMultistepScheduler (EDM sigmas), but
    since this adapter treats the model as a rectified flow, time_grid() is the same
    FlowMatchEulerDiscreteScheduler grid as the image policy's. The pipeline's `scheduler` config is
    therefore not read (that scheduler's defaults, num_train_timesteps = 1000, unless
    `scheduler_config` is given).

    decode() with an AutoencoderOobleck gives its waveform (at its sampling rate); without a VAE the
    latent channels are the waveform. Both are clipped to [-1, 1].
    """

    lora_target_modules: ClassVar[list[str]] = STABLE_AUDIO_LORA_TARGETS
    _transformer_class = "StableAudioDiTModel"
    _vae_class = "AutoencoderOobleck"
    _hidden_width_key = "cross_attention_input_dim"
    _pooled_width_key = "global_states_input_dim"

    def __init__(
        self,
        transformer: nn.Module,
        vae: nn.Module | None = None,
        prompt_encoder: PromptEncoder | None = None,
        latent_length: int | None = None,
        sample_rate: int | None = None,
        scheduler_config: Mapping[str, Any] | None = None,
    ):
        super().__init__(transformer, vae, prompt_encoder, scheduler_config)
        config = transformer.config
        length = int(config["sample_size"] if latent_length is None else latent_length)
        self._latent_shape = (int(config["in_channels"]), length)
        vae_rate = None if vae is None else getattr(vae.config, "sampling_rate", None)
        self.sample_rate = int(sample_rate or vae_rate or 8000)
        self._rotary_dim = int(config["attention_head_dim"]) // 2
        self._rotary_cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return self._latent_shape

    def _rotary(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) rotary tables for `positions` tokens, as StableAudioPipeline builds them."""
        from diffusers.models.embeddings import get_1d_rotary_pos_embed

        key = (positions, str(device))
        if key not in self._rotary_cache:
            cos, sin = get_1d_rotary_pos_embed(
                self._rotary_dim, positions, use_real=True, repeat_interleave_real=False
            )
            self._rotary_cache[key] = (cos.to(device), sin.to(device))
        return self._rotary_cache[key]

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        """eps - x0 predicted at (x_t, t); x_t is [B, C, T] and t is [B] in [0, 1]."""
        device, dtype = _module_device_dtype(self.transformer)
        global_states = cond[POOLED_KEY].to(device=device, dtype=dtype).unsqueeze(1)
        out = self.transformer(
            hidden_states=x_t.to(device=device, dtype=dtype),
            timestep=self._timesteps(t, x_t.shape[0], device).to(dtype),
            encoder_hidden_states=cond[HIDDEN_KEY].to(device=device, dtype=dtype),
            global_hidden_states=global_states,
            rotary_embedding=self._rotary(x_t.shape[-1] + global_states.shape[1], device),
            return_dict=True,
        ).sample
        return out.to(x_t.dtype)

    def decode(self, x0: torch.Tensor) -> MediaBatch:
        """Waveform [B, channels, S] clipped to [-1, 1]."""
        if self.vae is not None:
            audio = self.vae.decode(self._vae_input(x0)).sample.float()
        else:
            audio = x0.float()
        return MediaBatch(audio=audio.clamp(-1.0, 1.0), sample_rate=self.sample_rate)
