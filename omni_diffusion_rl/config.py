"""Typed experiment configs: YAML files plus dotted command-line overrides.

Every value is checked before any work starts; an error names the key, what was given and
what is allowed.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .algorithm_options import algorithm_card
from .config_checks import ROUTE_KEYS as ROUTE_KEYS
from .config_checks import check_consistency
from .config_fields import NO_TEACHER as NO_TEACHER
from .config_fields import REWARD_MODALITIES as REWARD_MODALITIES
from .config_fields import ConfigError as ConfigError
from .config_fields import check_registered_name as check_registered_name
from .config_fields import config_field as _spec
from .config_fields import option as option
from .config_yaml import MAX_CONFIG_BYTES as MAX_CONFIG_BYTES
from .config_yaml import MAX_DEPTH as MAX_DEPTH
from .config_yaml import _check_depth, _set_dotted, _shown
from .config_yaml import check_input_file as check_input_file
from .config_yaml import parse_override as parse_override
from .config_yaml import read_config_file as read_config_file
from .config_yaml import read_text_bounded as read_text_bounded

# Bounds on the counts and sizes that allocate: a config, a command line and a checkpoint (which imports
# these) are held to the same ones, each far beyond any real run.
MAX_STEP = 10**9
"""The most optimizer steps (train.steps; the largest step a checkpoint may record)."""
MAX_LORA_RANK = 512
"""The largest LoRA rank: 8x the reference recipes' 64 (rank 512 adapters on a 14B model's attention
already take tens of GiB; a rank of millions would try to allocate terabytes)."""
MAX_SAMPLING_STEPS = 1000
"""The most sampler steps (sampling.num_steps, sampling.eval_num_steps, odrl sample --steps): flow
samplers use tens; 1000 is a whole DDPM schedule."""
MAX_GROUP_SIZE = 1024
"""The most samples per prompt (data.group_size): the references use 8 to 24."""
MAX_PROMPTS_PER_STEP = 65536
"""The most prompt groups per optimizer step (data.prompts_per_step), over all processes."""
MAX_EVAL_SAMPLES = 1 << 20
"""The most held-out samples of an evaluation (data.eval_samples)."""
MAX_CLIP_FPS = 240.0
"""The most video frames a second a question file's clips are decoded at (data.clip_fps)."""
MAX_SEED = 2**32 - 1
"""The largest seed (train.seed): numpy's generators take 32 bits."""


@dataclass
class ModelConfig:
    family: str = _spec(
        "tiny_av",
        "policy family: tiny_av (built-in) | tiny_sync (built-in, the sync world) | sd3 | stable_audio "
        "| ltx2 | minimax_h3 | answering: tiny_omni (built-in) | qwen2_5_omni | qwen3_omni "
        "| a registered family",
    )
    pretrained: str = _spec("builtin", "'builtin' (shipped tiny base), a local directory or a hub id")
    lora_rank: int = _spec(16, "LoRA rank of both adapters", ge=1, le=MAX_LORA_RANK)
    lora_alpha: float = _spec(32.0, "LoRA alpha (reference recipes use 2 x rank)", gt=0)
    lora_targets: list[str] = _spec([], "module names to adapt; empty = the family's default")
    options: dict[str, Any] = _spec(
        {},
        "the family's own options, e.g. ltx2: {height: 512, width: 768, num_frames: 121, frame_rate: 24, "
        "max_sequence_length: 1024, vae_tiling: null, vae_slicing: false} (the clip size it generates and "
        "decoding memory); minimax_h3: {height: 768, width: 1344, num_frames: 124, text_encoder_layer: 50, "
        "max_sequence_length: 512, vae_tiling: null, vae_slicing: false}",
    )
    base_dtype: str = _spec(
        "fp32",
        "how the frozen base weights (transformer, VAEs, text encoder) are stored: bf16 halves their "
        "memory, what 10B+ models need (ltx2, minimax_h3); the LoRA adapters and optimizer stay fp32",
        choices=("fp32", "bf16"),
    )
    gradient_checkpointing: bool = _spec(
        False, "recompute the transformer's blocks in the backward pass: less memory, about 1/3 more compute"
    )


@dataclass
class SamplingConfig:
    solver: str = _spec("euler", "ODE solver for rollouts", choices=("euler", "heun"))
    num_steps: int = _spec(
        10,
        "sampling steps for training rollouts (also the training timestep grid)",
        ge=1,
        le=MAX_SAMPLING_STEPS,
    )
    eval_num_steps: int = _spec(20, "sampling steps for evaluation and previews", ge=1, le=MAX_SAMPLING_STEPS)
    time_shift: float = _spec(1.0, "sigma shift s: t' = s t / (1 + (s - 1) t)", gt=0)
    rollout_chunks: int = _spec(
        1,
        "split each step's rollout into chunks of prompt groups; a chunk is scored while the next generates",
        ge=1,
    )
    cfg_scale: float = _spec(
        1.0,
        "classifier-free guidance of rollouts, evaluation and previews, v = v(empty) + s (v(prompt) - "
        "v(empty)) (1: off; two forwards per step otherwise); only flow_grpo trains with it",
        ge=1,
    )


@dataclass
class AlgorithmConfig:
    """The algorithm section: which algorithm and what every algorithm reads. The chosen algorithm's
    own options sit flat beside them (algorithm.beta, algorithm.raft_keep): the section is built as
    `AlgorithmConfig` joined with that algorithm's options dataclass (its `options_type`), see
    `algorithm_section`. An algorithm that declares no options dataclass reads `algorithm.options`."""

    name: str = _spec(
        "nft",
        "what the trainer learns with: nft (DiffusionNFT) | flow_grpo (Flow-GRPO; MixGRPO with "
        "sde_window_size) | raft (reward-ranked flow-matching fine-tuning, a baseline) | distill "
        "(on-policy distillation from `teacher`) | gspo (an answering language "
        "model, model.family=tiny_omni) | a registered algorithm",
    )
    timestep_fraction: float = _spec(0.6, "fraction of the sampler grid trained per sample", gt=0, le=1)
    options: dict[str, Any] = _spec(
        {}, "the options (key -> value) of a registered algorithm that declares no options dataclass"
    )
    plugins: list[str] = _spec(
        [],
        "modules or .py files to import before algorithm.name is looked up: they register algorithms "
        "with @algorithms.register (e.g. [examples/advantage_weighted_fm.py])",
    )


@dataclass
class TeacherConfig:
    name: str = _spec("policy", "registered teacher (teachers/): policy serves a model family's policy")
    options: dict[str, Any] = _spec(
        {},
        "the teacher's options, e.g. {pretrained: builtin-teacher, cfg_scale: 1.0, device: cuda:1} "
        "(policy's default: the shipped tiny teacher, guided at 3); in process, when no urls are given",
    )
    urls: list[str] = _spec(
        [],
        "teacher servers (odrl serve-teacher NAME) to route requests across; empty: the teacher in process",
    )
    timeout_s: float = _spec(
        60.0, "per request to a teacher server; longer: retried on another replica", gt=0
    )
    retries: int = _spec(3, "extra attempts of a request, each on another replica when one is left", ge=0)
    request_samples: int = _spec(16, "states per request to a teacher server (sent concurrently)", ge=1)
    health_every_s: float = _spec(
        1.0, "how often a failed replica's /health is asked before it rejoins", gt=0
    )
    token_env: str = _spec("ODRL_TEACHER_TOKEN", "environment variable holding the teacher servers' token")
    overlap: bool = _spec(
        True,
        "ask the teacher on its own thread while the next chunk generates and this one is scored; false: "
        "ask after each chunk and wait (the blocking schedule, for comparison)",
    )
    routes: dict[str, Any] = _spec(
        {},
        "teachers per part of the latent: {ROUTE: {parts: [picture, visibility], name: policy, "
        "options: {...}, urls: [...]}, ...}; each route its own teacher (or name: none, no teacher) and "
        "server pool; every part of the student's latent in exactly one route; empty: the one teacher "
        "above for every part",
    )
    one_step_off: bool = _spec(
        False,
        "colocated distillation: make the next step's rollouts, and send them to the teacher, before "
        "this step trains, so that the teacher answers while this step trains; a step then trains on "
        "rollouts one update old (logged as experience/staleness), except the first and the one after "
        "each checkpoint; none is made past the last step",
    )


@dataclass
class OptimConfig:
    lr: float = _spec(2e-3, "AdamW learning rate (the tiny default; reference recipes use 3e-4)", gt=0)
    weight_decay: float = _spec(1e-4, "AdamW weight decay", ge=0)
    grad_clip: float = _spec(1.0, "max gradient norm (0 disables)", ge=0)


@dataclass
class DataConfig:
    prompts: str = _spec(
        "builtin:tiny_world",
        "training prompts: builtin:tiny_world, a UTF-8 text file, or a question file (.jsonl: train lines)",
    )
    eval_prompts: str = _spec(
        "builtin:tiny_world_heldout",
        "held-out prompts for before/after evaluation (a question file: its heldout lines)",
    )
    prompts_per_step: int = _spec(
        8, "prompt groups per optimizer step (over all processes)", ge=1, le=MAX_PROMPTS_PER_STEP
    )
    group_size: int = _spec(8, "samples per prompt (K); advantages need at least 2", ge=2, le=MAX_GROUP_SIZE)
    eval_samples: int = _spec(
        256,
        "held-out samples for the before/after evaluation (eval_samples / prompts per prompt)",
        ge=1,
        le=MAX_EVAL_SAMPLES,
    )
    questions: str = _spec(
        "tiny_avqa",
        "answering runs: the registered question set that prompts not from a question file name",
    )
    clip_fps: float = _spec(
        8.0,
        "question files: video frames a second the clips are decoded at (the model's own)",
        gt=0,
        le=MAX_CLIP_FPS,
    )
    clip_sample_rate: int = _spec(
        8000, "question files: audio samples a second (files at another rate are skipped)", ge=1
    )
    clip_seconds: float = _spec(0.5, "question files: the clip length read from each file", gt=0, le=600)
    clip_channels: int = _spec(
        1, "question files: audio channels (files with another count are skipped)", ge=1
    )
    audio_from_video: str = _spec(
        "auto",
        "question files: a line naming a video and no audio reads the video's own sound track (auto; a "
        "file without one is skipped with its reason) or silence (never)",
        choices=("auto", "never"),
    )
    choice_format: str = _spec(
        "{question} options : {options}",
        "question files: a multiple-choice line as the model reads it ({question}, {options})",
    )
    option_format: str = _spec("{text}", "question files: each option in choice_format ({letter}, {text})")
    option_separator: str = _spec(" ", "question files: between two options in choice_format")
    system_prompt: str | None = _spec(
        None, "answering runs: a system turn before each question (a chat model's template; null: none)"
    )


@dataclass
class RewardConfig:
    weights: dict[str, float] = _spec(
        {
            "color_match": 1.0,
            "shape_match": 1.0,
            "pitch_match": 1.0,
            "timing_match": 1.0,
            "av_sync": 0.5,
            "clean_background": 0.5,
            "group_diversity": 0.5,
        },
        "registered reward name -> weight; the reward is the weighted mean",
    )
    options: dict[str, dict[str, Any]] = _spec(
        {}, "reward name -> keyword arguments for it, e.g. {clap: {checkpoint: /models/clap}}"
    )
    plugins: list[str] = _spec(
        [], "modules to import first: they register rewards with @rewards.register (e.g. my_pkg.rewards)"
    )
    modalities: dict[str, str] = _spec(
        {},
        "reward name -> the modality it judges (video | audio | audio_video), over what the reward "
        "declares (its `modality` attribute); algorithm.credit=per_modality routes by it",
    )
    url: str = _spec(
        "",
        "reward server (odrl serve-reward), e.g. http://127.0.0.1:8400; rewards it serves are scored there",
    )
    token_env: str = _spec(
        "ODRL_REWARD_TOKEN", "environment variable holding the reward server's bearer token"
    )
    timeout_s: float = _spec(120.0, "seconds before a reward request is abandoned and retried", gt=0)
    request_retries: int = _spec(
        6, "retries of a request the server did not answer (down, timeout, 5xx)", ge=0
    )
    retries: int = _spec(
        1, "retries of a reward that raised or gave NaN, before its samples are dropped", ge=0
    )
    max_failed_fraction: float = _spec(
        0.25,
        "a step stops with an error when more than this share of its samples cannot be scored",
        ge=0,
        le=1,
    )


@dataclass
class EvalConfig:
    metrics: list[str] = _spec(
        ["tiny_world_judge"],
        "registered scorers logged on the held-out prompts and never trained on (tiny_world_judge: the "
        "tiny world's per-attribute accuracy and health signs; for real models e.g. [imagebind])",
    )
    options: dict[str, dict[str, Any]] = _spec({}, "metric name -> keyword arguments for it")
    every: int = _spec(
        0,
        "steps between held-out evaluations during training, logged with the training seconds and the "
        "samples generated so far (0: only at the start and end, train.eval_at_start_and_end)",
        ge=0,
    )


@dataclass
class TrainConfig:
    steps: int = _spec(240, "optimizer steps", ge=1, le=MAX_STEP)
    seed: int = _spec(0, "seed for prompts, noise and initialisation", ge=0, le=MAX_SEED)
    output_dir: str = _spec("runs/tiny_t2av_nft", "where metrics, previews and checkpoints go (one run each)")
    overwrite: bool = _spec(
        False, "start over in an output_dir that holds a run: delete its checkpoints, metrics and previews"
    )
    log_every: int = _spec(1, "steps between metric records", ge=1)
    preview_every: int = _spec(20, "steps between previews (0 disables)", ge=0)
    checkpoint_every: int = _spec(20, "steps between checkpoints (0: only at the end)", ge=0)
    eval_at_start_and_end: bool = _spec(True, "evaluate held-out reward before and after training")
    deterministic: bool = _spec(True, "torch deterministic algorithms (exact resume on CPU)")
    mixed_precision: str = _spec(
        "fp32",
        "bf16: the transformer's forward passes under bf16 autocast (trained weights, optimizer and "
        "losses stay fp32); fp32 also follows `accelerate launch --mixed_precision bf16`",
        choices=("fp32", "bf16"),
    )
    micro_batch_size: int = _spec(
        0,
        "samples per training forward and backward pass (0: all of a process's samples at once); "
        "smaller needs less activation memory for the same gradient (large models: 1-2)",
        ge=0,
    )
    progress: bool = _spec(True, "show a progress bar")
    sharding: str = _spec(
        "none",
        "fsdp: shard every transformer block of the policy (frozen base and adapters) and the in-process "
        "teacher over the training processes with torch's FSDP2, so each holds 1/N of the weights "
        "(needs a family with repeated blocks; also turned on by accelerate launch's FSDP config); "
        "none: every process holds whole copies",
        choices=("none", "fsdp"),
    )
    cpu_offload: bool = _spec(
        False,
        "with sharding=fsdp: keep the sharded weights in host memory between uses (gathered onto the "
        "device block by block); slower, for a base that does not fit the cards even when sharded",
    )


@dataclass
class TrackingConfig:
    wandb: bool = _spec(False, "log to Weights & Biases (offline unless WANDB_MODE says otherwise)")
    project: str = _spec("omni-diffusion-rl", "tracker project name")
    run_name: str = _spec("", "run name; empty = derived from the output directory")


@dataclass
class ExecutionConfig:
    mode: str = _spec(
        "colocated",
        "colocated: every process generates then all train; separate: rollout processes feed a trainer "
        "through a versioned buffer; hybrid: separate, and the trainer generates too while rollout "
        "cannot keep up; auto: measure the costs in the running processes, predict each mode with "
        "the simulator, run the fastest",
        choices=("colocated", "separate", "hybrid", "auto"),
    )
    rollout_replicas: int = _spec(
        1, "separate/hybrid: processes that only generate; the other (first) ones train (auto sets it)", ge=1
    )
    sync_every: int = _spec(1, "separate/hybrid: trainer steps between adapter syncs to rollout", ge=1)
    max_staleness: int = _spec(1, "separate/hybrid: trainer versions a sample may lag", ge=0)
    on_stale: str = _spec(
        "wait", "separate/hybrid: wait (hold rollout back) or drop stale groups", choices=("wait", "drop")
    )
    buffer_groups: int = _spec(
        0, "separate/hybrid: replay buffer capacity in prompt groups (0: 2 steps' worth)", ge=0
    )
    data_timeout_s: float = _spec(
        300.0, "separate/hybrid: stop with an error when no rollout data came for this long", gt=0
    )
    sync_timeout_s: float = _spec(
        60.0, "separate/hybrid: a weight sync not delivered within this is an error", gt=0
    )
    lend_threshold: float = _spec(
        1.0,
        "hybrid: the trainer may generate while the buffer holds less than this share of a step (and "
        "the expected wait covers the lent call)",
        ge=0,
    )
    auto_repeats: int = _spec(1, "auto: timed repeats of each warm-up measurement", ge=1)
    auto_costs: str = _spec(
        "", "auto: a unit costs JSON (odrl simulate --measure, an auto run's summary.json): no warm-up"
    )
    auto_recheck_every: int = _spec(
        20, "auto: steps between re-checks of the pick against the run's own timings (0: never)", ge=0
    )
    auto_switch_margin: float = _spec(
        0.1, "auto: switch modes only when another is predicted faster by this fraction", ge=0, le=0.9
    )


@dataclass
class ExperimentConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    algorithm: AlgorithmConfig = field(default_factory=lambda: default_algorithm_section())
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    execution: ExecutionConfig = field(default_factory=ExecutionConfig)
    teacher: TeacherConfig = field(default_factory=TeacherConfig)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------
# Building and checking


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Value checked (and int widened to float) against the annotation `tp`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for option in typing.get_args(tp):
            if option is type(None) and value is None:
                return None
            try:
                return _coerce(key, value, option)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}: {value!r} matches none of {_type_name(tp)}")
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {type(value).__name__} {value!r}")
        (item_tp,) = typing.get_args(tp)
        return [_coerce(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping, got {type(value).__name__} {value!r}")
        k_tp, v_tp = typing.get_args(tp)
        return {_coerce(f"{key} key", k, k_tp): _coerce(f"{key}.{k}", v, v_tp) for k, v in value.items()}
    if tp is Any:
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {type(value).__name__} {value!r}")
        if not math.isfinite(value):
            raise ConfigError(f"{key}: {value!r} is not a finite number")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {type(value).__name__} {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {type(value).__name__} {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {_type_name(tp)}")


def _check_range(key: str, value: Any, meta: dict[str, Any]) -> None:
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(map(str, meta['choices']))}")
    bounds = {
        "gt": (lambda v, b: v > b, ">"),
        "ge": (lambda v, b: v >= b, ">="),
        "le": (lambda v, b: v <= b, "<="),
    }
    failed = [
        f"{sym} {meta[name]}"
        for name, (ok, sym) in bounds.items()
        if name in meta and not ok(value, meta[name])
    ]
    if failed:
        raise ConfigError(
            f"{key}: {value!r} is out of range; it must be {' and '.join(failed)} ({meta.get('doc', '')})"
        )


def _build(cls: type, data: dict[str, Any], prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix or 'config'}: expected a mapping of keys, got {_shown(repr(data))}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields), key=str)  # keys may be numbers, null, ...
    if unknown:
        where = f"section '{prefix}'" if prefix else "the top level"
        raise ConfigError(
            f"unknown config key '{prefix + '.' if prefix else ''}{_shown(str(unknown[0]))}' in {where}; "
            f"allowed keys: {', '.join(fields)}"
        )
    kwargs = {}
    for name, value in data.items():
        key = f"{prefix}.{name}" if prefix else name
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value, key)
        else:
            coerced = _coerce(key, value, tp)
            _check_range(key, coerced, dict(fields[name].metadata))
            kwargs[name] = coerced
    return cls(**kwargs)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """The config from an optional YAML file and `key=value` overrides, fully checked."""
    data = read_config_file(path) if path is not None else {}
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def config_from_dict(data: dict[str, Any]) -> ExperimentConfig:
    """The config these sections give, fully checked."""
    _check_depth(data)
    others = {k: v for k, v in data.items() if k != "algorithm"} if isinstance(data, dict) else data
    cfg = _build(ExperimentConfig, others, "")
    _import_reward_plugins(cfg.reward.plugins)
    cfg.algorithm = algorithm_section(data.get("algorithm", {}))  # imports algorithm.plugins first
    check_consistency(cfg)
    return cfg


# ---------------------------------------------------------------------------------------------
# The algorithm section: the shared keys and the chosen algorithm's own options, routed by declaration


def algorithm_section_type(name: str) -> type:
    """The dataclass of algorithm `name`'s section: AlgorithmConfig joined with its options dataclass."""
    options = algorithm_card(name).options_type
    return AlgorithmConfig if options is None else _joined_section(options)


@functools.cache
def _joined_section(options: type) -> type:
    """AlgorithmConfig's fields, then `options`' (one class per options type, so sections compare equal)."""
    check_options_type(options)
    clash = sorted(_field_names(options) & _field_names(AlgorithmConfig))
    if clash:
        raise ConfigError(f"{options.__name__} declares {', '.join(clash)}, which every algorithm shares")
    section = dataclasses.make_dataclass(f"{options.__name__}Section", [], bases=(options, AlgorithmConfig))
    section.__reduce__ = _reduce_section  # type: ignore[attr-defined]  # pickled by name and values
    return section


def check_options_type(options: Any) -> None:
    """A ConfigError unless `options` is a plain dataclass whose every field has a default (the
    algorithm section is built from it with any subset of its keys)."""
    name = getattr(options, "__name__", repr(options))
    if not (isinstance(options, type) and dataclasses.is_dataclass(options)):
        raise ConfigError(f"an algorithm's options_type must be a dataclass; {name} is not")
    if options.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        raise ConfigError(f"an algorithm's options_type must not be frozen: {name} is")
    missing = [
        f.name
        for f in dataclasses.fields(options)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    if missing:
        raise ConfigError(f"{name}'s fields {', '.join(missing)} have no default; give each option one")


def _reduce_section(section: AlgorithmConfig) -> tuple[Any, tuple[str, dict[str, Any]]]:
    """Pickle an algorithm section as its algorithm's name and its values (its class is made at run
    time, so it is rebuilt by name)."""
    return _rebuilt_section, (
        section.name,
        {f.name: getattr(section, f.name) for f in dataclasses.fields(section)},
    )


def _rebuilt_section(name: str, values: dict[str, Any]) -> AlgorithmConfig:
    import_plugins(values.get("plugins", []), "algorithm.plugins")  # another process may not have them yet
    return algorithm_section_type(name)(**values)


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def default_algorithm_section() -> AlgorithmConfig:
    """The algorithm section of a config that gives none: the default algorithm's, at its defaults."""
    return algorithm_section_type(AlgorithmConfig.name)()


def algorithm_section(data: Any, prefix: str = "algorithm") -> AlgorithmConfig:
    """The algorithm section `data` gives, checked: the shared keys, then the named algorithm's own
    options (the keys its options dataclass declares). A key another algorithm declares is dropped
    when it holds that algorithm's default (old configs and checkpoints wrote every algorithm's
    keys); any other value of it is checked as that algorithm checks it, then refused."""
    if not isinstance(data, dict):
        return _build(AlgorithmConfig, data, prefix)  # raises: not a mapping
    shared = _field_names(AlgorithmConfig)
    common = _build(AlgorithmConfig, {k: v for k, v in data.items() if k in shared}, prefix)
    import_plugins(common.plugins, f"{prefix}.plugins")  # they may register the algorithm
    name = common.name
    section = algorithm_section_type(name)
    built = _build(
        section, {k: v for k, v in data.items() if not _foreign(section, name, k, v, prefix)}, prefix
    )
    own = [f.name for f in dataclasses.fields(section) if f.name not in shared]
    if own and built.options:
        raise ConfigError(
            f"{prefix}.options={_shown(repr(built.options))}: {name} reads its own keys of the section "
            f"({', '.join(own)}); {prefix}.options is for an algorithm that declares no options"
        )
    return built


def _foreign(section: type, name: str, key: Any, value: Any, prefix: str) -> bool:
    """True for an option of another algorithm at its default (at the default of any algorithm that
    declares it: to drop); a ConfigError for one at any other value; False for a key of `section` or
    one no algorithm declares (_build judges it)."""
    if key in _field_names(section):
        return False
    owners = declaring_algorithms(key)
    if not owners:
        return False
    for owner in owners:  # several may declare it, each with its own default
        theirs_type = _joined_section(algorithm_card(owner).options_type)
        theirs = _build(theirs_type, {"name": owner, key: value}, prefix)  # a ConfigError if malformed
        if getattr(theirs, key) == getattr(theirs_type(), key):
            return True
    raise ConfigError(
        f"{prefix}.{key}={_shown(repr(value))} is an option of {' and '.join(owners)}, not of {name}: "
        f"{prefix}.name={name} would ignore it; set {prefix}.name={' or '.join(owners)} or leave it out"
    )


def foreign_option_defaults(section: AlgorithmConfig, name: str) -> dict[str, Any]:
    """The keys of `section` that algorithm `name` does not read but another declares, each at its
    default: overrides that let a config written for one algorithm run another (their keys at the
    default are dropped as the section is built)."""
    own = _field_names(algorithm_section_type(name))
    defaults = dataclasses.asdict(type(section)())
    return {
        key: defaults[key]
        for key, value in dataclasses.asdict(section).items()
        if key not in own and value != defaults[key]
    }


def declaring_algorithms(key: Any) -> list[str]:
    """The registered algorithms whose options dataclass declares `key` (one that cannot be loaded
    or declares a malformed options class is skipped: it is not the one this config chose)."""
    from .registry import algorithms

    owners = []
    for name in algorithms.names():
        try:
            options = algorithm_card(name).options_type
            if options is not None:
                check_options_type(options)
        except Exception:  # noqa: BLE001 - another plug-in's failure is not this config's error
            continue
        if options is not None and key in _field_names(options):
            owners.append(name)
    return owners


def _import_reward_plugins(modules: list[str]) -> None:
    """reward.plugins imported; one that registers an algorithm still works for this release, with a
    FutureWarning that names algorithm.plugins, the key for algorithm files."""
    import warnings

    from .registry import algorithms

    before = set(algorithms.names())
    import_plugins(modules)
    added = sorted(set(algorithms.names()) - before)
    if added:
        warnings.warn(
            f"reward.plugins={modules} registered the algorithm(s) {', '.join(added)}: list algorithm "
            "files in algorithm.plugins instead; reward.plugins will stop being read for algorithms in the "
            "next release",
            FutureWarning,
            stacklevel=3,
        )


def import_plugins(modules: list[str], key: str = "reward.plugins") -> None:
    """Import modules that register plug-ins: a module name (installed, or on PYTHONPATH) or a path
    to a .py file. One that cannot be imported is a ConfigError naming `key`."""
    import importlib
    import importlib.util
    import sys

    for module in modules:
        try:
            if not module.endswith(".py"):
                importlib.import_module(module)
                continue
            path = Path(module).resolve()
            check_input_file(path, f"{key} file")
            name = f"odrl_plugin_{re.sub(r'[^0-9A-Za-z_]', '_', path.stem)}"
            if getattr(sys.modules.get(name), "__file__", None) == str(path):
                continue  # imported already (every config load checks the plugins)
            spec = importlib.util.spec_from_file_location(name, path)
            loaded = importlib.util.module_from_spec(spec)
            sys.modules[name] = loaded
            spec.loader.exec_module(loaded)
        except ConfigError:
            raise
        except SystemExit as e:  # a module that exits when imported would end odrl without a word
            raise ConfigError(
                f"{key}: importing '{module}' called sys.exit({e.code!r}); a plug-in module must "
                "register its plug-ins, not exit"
            ) from e
        except Exception as e:
            raise ConfigError(
                f"{key}: cannot import '{module}' ({type(e).__name__}: {e}); name an importable module "
                f"(installed, or on PYTHONPATH) or a .py file, e.g. {key}=[./my_plugins.py]"
            ) from e


def describe(cls: type = ExperimentConfig, prefix: str = "") -> list[str]:
    """One line per key: name, type, default, doc (for --help and the docs)."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            lines += describe(hints[f.name], key + ".")
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        lines.append(f"{key} ({_type_name(hints[f.name])}, default {default!r}): {f.metadata.get('doc', '')}")
    if cls is AlgorithmConfig:
        lines += describe_algorithm_options(prefix)
    return lines


def describe_algorithm_options(prefix: str = "algorithm.") -> list[str]:
    """Each registered algorithm's own options under its name, one indented line per key (another
    algorithm's options that it reads too, as distill reads nft's, are named, not repeated)."""
    from .registry import algorithms

    lines, loaded = [], {}
    for name in algorithms.names():
        try:
            loaded[name] = algorithm_card(name)
            options = loaded[name].options_type
            if options is not None:
                check_options_type(options)
        except Exception as e:  # a broken plug-in must not take --help down with it
            loaded.pop(name, None)
            lines.append(f"{prefix}name={name}: cannot be loaded ({type(e).__name__}: {e})")
    declared = {name: card.options_type for name, card in loaded.items()}
    for name, options in declared.items():
        title = f"{prefix}name={name} ({loaded[name].display_name})"
        if options is None:
            lines.append(f"{title} reads {prefix}options")
            continue
        within = [n for n, o in declared.items() if o not in (None, options) and issubclass(options, o)]
        also = "".join(f" {n}'s options and" for n in within)
        lines.append(f"{title} reads{also}:")
        skip = {key for n in within for key in _field_names(declared[n])}
        keys = [f.name for f in dataclasses.fields(options)]
        lines += [
            f"  {line}" for key, line in zip(keys, describe(options, prefix), strict=True) if key not in skip
        ]
    return lines
