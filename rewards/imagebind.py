"""ImageBind reward: cosine similarities in ImageBind's joint embedding space (audio, video, text).

Modes (`mode=`):
  audio_video (default)  cosine of the audio and the vision embedding of each sample (prompts unused)
  text_audio             cosine of the prompt's text embedding and the audio embedding
  text_video             cosine of the prompt's text embedding and the vision embedding
  all                    sum_i w_i * cosine_i / sum_i w_i over the three, returned as a RewardOutput whose
                         components hold the three cosines (weights: 1 each by default; `weights=`
                         updates them)

Every embedding is L2-normalised again before the cosine: ImageBind's heads scale audio (x20) and text
(learnt logit scale) after normalising, and averaging the embeddings of several clips shrinks them, so
the model's outputs are not unit vectors. Scores lie in [-1, 1].

Licence: ImageBind's code and weights are CC BY-NC-SA 4.0, i.e. NON-COMMERCIAL use only. This module only
loads them; using this reward (and models trained with it) is subject to that licence.

Install (CPU torch is kept; the package's declared dependencies would pull torchvision, torchaudio,
pytorchvideo and a CUDA torch, and none of them is needed here):

    pip install --no-deps imagebind-unofficial==0.1.1 timm==1.0.31
    pip install einops==0.8.2 iopath==0.1.10 ftfy==6.3.1 regex

Without torchvision, an importable timm breaks the `accelerate` command (its `estimate` subcommand
imports timm, whose layers import torchvision). So `make setup` puts ImageBind's code and timm in a
side folder instead, `<venv>/imagebind-site` (`pip install --no-deps --target`), which only this
loader searches; `ODRL_IMAGEBIND_SITE=/path` names another one. An ImageBind importable from sys.path
(a GPU install with torchvision) is found as well.

Weights: download https://dl.fbaipublicfiles.com/imagebind/imagebind_huge.pth yourself and pass its path:

    reward: {weights: {imagebind: 1.0}, options: {imagebind: {checkpoint: /models/imagebind_huge.pth,
                                                              device: cuda, mode: all}}}

How the package is imported: `imagebind/__init__.py` imports `imagebind.data` (torchaudio, torchvision,
pytorchvideo) and every timm release with `timm.layers` imports torchvision from `timm/layers/__init__.py`
(norm_act.py needs torchvision.ops). ImageBind's model modules only need two pure-torch timm functions,
`trunc_normal_` and `DropPath`. So `load_imagebind()` registers the `imagebind` and `timm.layers` packages
from their real specs without running their `__init__`, imports timm's real `weight_init` and `drop`
modules, binds those two names on `timm.layers` (as timm's `__init__` does), imports ImageBind's real
`imagebind.models.*` modules, and then removes every `imagebind*`/`timm*` entry it added to sys.modules,
so nothing half-initialised is left behind. No code is replaced or stubbed.

Preprocessing is described in rewards/imagebind_preprocess.py; nothing in it is random.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits, RewardOutput
from rewards import imagebind_preprocess as prep

SITE_ENV = "ODRL_IMAGEBIND_SITE"
DEFAULT_SITE = os.path.join(sys.prefix, "imagebind-site")
INSTALL_COMMAND = (
    "pip install --no-deps imagebind-unofficial==0.1.1 timm==1.0.31 && "
    "pip install einops==0.8.2 iopath==0.1.10 ftfy==6.3.1 regex"
)
CHECKPOINT_URL = "https://dl.fbaipublicfiles.com/imagebind/imagebind_huge.pth"
MODES = ("audio_video", "text_audio", "text_video", "all")
COMPONENTS = ("audio_video", "text_audio", "text_video")
JUDGED_BY_MODE: dict[str, str | None] = {
    "audio_video": "audio_video",
    "text_audio": "audio",
    "text_video": "video",
    "all": None,
}
"""The modality each mode judges (the reward's `modality`, for per-modality credit). Mode 'all'
declares none: its text-video part would credit the sound and its text-audio part the picture, so
per-modality credit refuses it unless reward.modalities says otherwise."""
MODEL_DEPENDENCIES = ("einops", "iopath", "ftfy", "regex")  # importable from sys.path
SIDE_PACKAGES = ("imagebind", "timm")  # from the side folder when there is one, else sys.path
BPE_FILE = os.path.join("bpe", "bpe_simple_vocab_16e6.txt.gz")

# A random-init ImageBindModel small enough for tests and smoke runs (about 2 M parameters, most of them
# the 49408-token text embedding). Input sizes are the real ones: 224x224 frames, 128x204 fbank, 77 tokens.
TINY_ARCHITECTURE: dict[str, Any] = {
    "out_embed_dim": 16,
    "vision_embed_dim": 32,
    "vision_num_blocks": 1,
    "vision_num_heads": 2,
    "audio_embed_dim": 32,
    "audio_num_blocks": 1,
    "audio_num_heads": 2,
    "text_embed_dim": 32,
    "text_num_blocks": 1,
    "text_num_heads": 2,
    "depth_embed_dim": 16,
    "depth_num_blocks": 1,
    "depth_num_heads": 2,
    "thermal_embed_dim": 16,
    "thermal_num_blocks": 1,
    "thermal_num_heads": 2,
    "imu_embed_dim": 16,
    "imu_num_blocks": 1,
    "imu_num_heads": 2,
}


@dataclass(frozen=True)
class ImageBindModules:
    """ImageBind's model module, its preprocessors module (SimpleTokenizer) and the BPE vocabulary path."""

    model: ModuleType
    preprocessors: ModuleType
    bpe_path: str


_LOCK = threading.Lock()
_LOADED: dict[str, ImageBindModules] = {}


def _missing(message: str) -> ImportError:
    return ImportError(f"reward 'imagebind': {message}. Install it with: {INSTALL_COMMAND}")


def default_search_path() -> list[str]:
    """Where `imagebind` and `timm` are looked for: $ODRL_IMAGEBIND_SITE, else the venv's side folder
    (when it exists), then sys.path."""
    site = os.environ.get(SITE_ENV) or (DEFAULT_SITE if os.path.isdir(DEFAULT_SITE) else None)
    return [site, *sys.path] if site else list(sys.path)


def imagebind_available() -> bool:
    """Whether ImageBind's code can be found (it may still lack a dependency)."""
    return importlib.machinery.PathFinder.find_spec("imagebind", default_search_path()) is not None


def load_imagebind(search_path: list[str] | None = None) -> ImageBindModules:
    """Import ImageBind's real model modules without `imagebind/__init__` and timm's torchvision imports.

    search_path: folders to look for the `imagebind` and `timm` packages in (default:
    default_search_path()). Raises ImportError naming the install command when the package or a
    dependency is missing, or when the `imagebind` found is PyPI's empty placeholder package.
    """
    search_path = default_search_path() if search_path is None else search_path
    spec = importlib.machinery.PathFinder.find_spec("imagebind", search_path)
    if spec is None or not spec.submodule_search_locations:
        raise _missing("the ImageBind package is not installed")
    package_dir = list(spec.submodule_search_locations)[0]
    model_file = os.path.join(package_dir, "models", "imagebind_model.py")
    bpe_path = os.path.join(package_dir, BPE_FILE)
    if not (os.path.isfile(model_file) and os.path.isfile(bpe_path)):
        raise _missing(
            f"the 'imagebind' package at {package_dir} has no models/imagebind_model.py or BPE vocabulary "
            "(PyPI's 'imagebind' is an empty placeholder; uninstall it: the code is in imagebind-unofficial)"
        )
    absent = [name for name in MODEL_DEPENDENCIES if importlib.util.find_spec(name) is None]
    if importlib.machinery.PathFinder.find_spec("timm", search_path) is None:
        absent.append("timm")
    if absent:
        raise _missing(f"ImageBind's model code needs packages that are not installed: {', '.join(absent)}")
    with _LOCK:
        if package_dir not in _LOADED:
            _LOADED[package_dir] = _import_models(spec, bpe_path, search_path)
        return _LOADED[package_dir]


def _register_uninitialised_package(name: str, path: list[str] | None) -> None:
    """Put the real package `name` in sys.modules from its spec, without executing its __init__.py."""
    spec = importlib.machinery.PathFinder.find_spec(name.rpartition(".")[2], path)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(f"package {name} not found")
    sys.modules[name] = importlib.util.module_from_spec(spec)


def _import_models(
    spec: importlib.machinery.ModuleSpec, bpe_path: str, search_path: list[str]
) -> ImageBindModules:
    before = set(sys.modules)
    try:
        if "imagebind" not in sys.modules:
            sys.modules["imagebind"] = importlib.util.module_from_spec(spec)
        if "timm.layers" not in sys.modules:
            if "timm" not in sys.modules:
                _register_uninitialised_package("timm", search_path)
            _register_uninitialised_package("timm.layers", sys.modules["timm"].__path__)
            layers = sys.modules["timm.layers"]
            # The two bindings timm/layers/__init__.py makes, from timm's own pure-torch modules.
            layers.trunc_normal_ = importlib.import_module("timm.layers.weight_init").trunc_normal_
            layers.DropPath = importlib.import_module("timm.layers.drop").DropPath
        model = importlib.import_module("imagebind.models.imagebind_model")
        preprocessors = importlib.import_module("imagebind.models.multimodal_preprocessors")
    except ImportError as e:
        raise _missing(f"importing ImageBind's model code failed ({type(e).__name__}: {e})") from e
    finally:
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("imagebind", "timm"):
                del sys.modules[name]
    return ImageBindModules(model=model, preprocessors=preprocessors, bpe_path=bpe_path)


def build_model(architecture: str | dict[str, Any] = "huge") -> torch.nn.Module:
    """A random-init ImageBindModel in eval mode: 'huge' (imagebind_huge) or ImageBindModel keyword arguments.

    load_checkpoint builds it under accelerate's init_empty_weights to skip the random initialisation.
    """
    modules = load_imagebind()
    if architecture == "huge":
        model = modules.model.imagebind_huge(pretrained=False)
    elif isinstance(architecture, dict):
        model = modules.model.ImageBindModel(**architecture)
    else:
        raise ValueError(
            f"architecture must be 'huge' or a dict of ImageBindModel arguments; got {architecture!r}"
        )
    return model.eval()


def load_checkpoint(
    checkpoint: str | os.PathLike[str], architecture: str | dict[str, Any] = "huge"
) -> torch.nn.Module:
    """An ImageBindModel with the state dict at `checkpoint` (e.g. imagebind_huge.pth), on the CPU."""
    path = os.path.expanduser(os.fspath(checkpoint))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward 'imagebind': checkpoint file '{path}' does not exist. Download {CHECKPOINT_URL} "
            "(licence CC BY-NC-SA 4.0, non-commercial) and pass its local path as checkpoint="
        )
    from accelerate import init_empty_weights

    load_imagebind()  # import outside the empty-weights context
    # Parameters on the meta device (shapes only, no 1.2 B-parameter random init); every one of them is
    # then assigned from the checkpoint. (torch.device("meta") fails: ImageBind's trunk calls .item().)
    with init_empty_weights():
        model = build_model(architecture)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
        state = torch.load(path, map_location="cpu", weights_only=True)  # a pre-zipfile checkpoint
    if not isinstance(state, dict):
        raise ValueError(f"reward 'imagebind': '{path}' holds a {type(state).__name__}, not a state dict")
    try:
        model.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(
            f"reward 'imagebind': the checkpoint '{path}' does not fit the {architecture!r} architecture: {e}"
        ) from e
    meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta:
        raise ValueError(f"reward 'imagebind': the checkpoint left {meta[:5]} uninitialised")
    return model.eval()


@rewards.register("imagebind")
class ImageBindReward:
    """ImageBind cosine reward in [-1, 1]; one score per sample (see the module docstring for the modes).

    checkpoint: local path of ImageBind's state dict (imagebind_huge.pth), loaded with weights_only=True.
        LICENCE: ImageBind's code and weights are CC BY-NC-SA 4.0 (non-commercial use only).
    architecture: 'huge' (the released model) or ImageBindModel keyword arguments for another size,
        e.g. TINY_ARCHITECTURE for tests.
    model: a ready-made ImageBindModel instead of a checkpoint (e.g. build_model(TINY_ARCHITECTURE)).
    mode: 'audio_video' (default), 'text_audio', 'text_video' or 'all'.
    weights: for mode 'all', weights of the components audio_video / text_audio / text_video (default 1 each).
    audio_clips, video_clips: at most this many 2 s clips per sample (ImageBind uses 3 and 5), spread evenly.
    spatial_crops: 1 (centre crop) or 3 (left/centre/right, ImageBind's video evaluation; 3x the cost).
    """

    # Frames are resized to 224 on their short side and audio resampled to 16 kHz before the model.
    input_limits = InputLimits(
        frames=2048,
        frame_height=4096,
        frame_width=4096,
        audio_samples=2 * 48_000 * 600,
        meant_for="ImageBind resizes frames to 224 and hears 2 s clips at 16 kHz: up to 2048 frames of "
        "4096 x 4096 and 10 minutes of stereo 48 kHz audio",
    )

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        device: str | torch.device = "cpu",
        model: torch.nn.Module | None = None,
        mode: str = "audio_video",
        weights: dict[str, float] | None = None,
        architecture: str | dict[str, Any] = "huge",
        audio_clips: int = prep.AUDIO_CLIPS,
        video_clips: int = prep.VIDEO_CLIPS,
        spatial_crops: int = 1,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"reward 'imagebind': mode must be one of {', '.join(MODES)}; got {mode!r}")
        self.modality = JUDGED_BY_MODE[mode]  # what per-modality credit routes it to
        if weights is not None and mode != "all":
            raise ValueError(f"reward 'imagebind': weights only apply to mode 'all'; the mode is {mode!r}")
        self.weights = {name: 1.0 for name in COMPONENTS}
        unknown = set(weights or {}) - set(COMPONENTS)
        if unknown:
            raise ValueError(
                f"reward 'imagebind': unknown weights {sorted(unknown)}; use {', '.join(COMPONENTS)}"
            )
        self.weights.update({k: float(v) for k, v in (weights or {}).items()})
        if any(w < 0 for w in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(
                f"reward 'imagebind': weights must be >= 0 with a positive sum; got {self.weights}"
            )
        if audio_clips < 1 or video_clips < 1:
            raise ValueError("reward 'imagebind': audio_clips and video_clips must be >= 1")
        if spatial_crops not in (1, 3):
            raise ValueError(f"reward 'imagebind': spatial_crops must be 1 or 3; got {spatial_crops}")
        if model is None and checkpoint is None:
            raise ValueError(
                "reward 'imagebind' needs a checkpoint: set reward.options={imagebind: {checkpoint: "
                f"/path/to/imagebind_huge.pth}} (download {CHECKPOINT_URL}; CC BY-NC-SA 4.0, "
                "non-commercial), or pass model="
            )
        modules = load_imagebind()
        if model is None:
            model = load_checkpoint(checkpoint, architecture)  # type: ignore[arg-type]
        self.mode = mode
        self.audio_clips = audio_clips
        self.video_clips = video_clips
        self.spatial_crops = spatial_crops
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = modules.preprocessors.SimpleTokenizer(bpe_path=modules.bpe_path)
        vision = self.model.modality_preprocessors["vision"]
        # video_frames = temporal patches x temporal kernel of the vision stem (2 for ImageBind).
        self.frames_per_clip = int(vision.patches_layout[0]) * int(vision.rgbt_stem.proj[1].kernel_size[0])

    def needs(self) -> tuple[bool, bool, bool]:
        """Whether the mode uses (video, audio, text)."""
        return (
            self.mode in ("audio_video", "text_video", "all"),
            self.mode in ("audio_video", "text_audio", "all"),
            self.mode != "audio_video",
        )

    def _check(self, media: MediaBatch, prompts: list[str]) -> None:
        if len(prompts) != len(media):
            raise ValueError(f"reward 'imagebind': {len(prompts)} prompts for {len(media)} media samples")
        video, audio, _ = self.needs()
        for name, wanted, tensor in (("video", video, media.video), ("audio", audio, media.audio)):
            if not wanted:
                continue
            if tensor is None:
                raise ValueError(
                    f"reward 'imagebind' (mode '{self.mode}') needs {name}; the media batch has none"
                )
            if tensor.shape[-1] == 0 or (name == "video" and tensor.shape[1] == 0):
                raise ValueError(f"reward 'imagebind': the {name} is empty, shape {tuple(tensor.shape)}")
            # a sample at a time: a mask of the whole batch would take a byte for every value
            bad = [i for i, sample in enumerate(tensor.detach()) if not bool(torch.isfinite(sample).all())]
            if bad:
                raise ValueError(
                    f"reward 'imagebind': {name} has non-finite values (NaN/inf) in samples {bad}"
                )

    def inputs(self, media: MediaBatch, prompts: list[str]) -> dict[str, torch.Tensor]:
        """The model's inputs: vision [B, V, 3, T, 224, 224], audio [B, A, 1, 128, 204], text [B, 77].

        Only the modalities the mode uses are computed; V and A count clips (x spatial crops).
        """
        self._check(media, prompts)
        video, audio, text = self.needs()
        inputs = {}
        if video:
            inputs["vision"] = prep.vision_inputs(
                media.video,  # type: ignore[arg-type]
                media.fps,
                self.video_clips,
                self.frames_per_clip,
                self.spatial_crops,
                device=self.device,  # only the frames ImageBind reads go there
            )
        if audio:
            features = prep.audio_features(media.audio, int(media.sample_rate), self.audio_clips)  # type: ignore[arg-type]
            inputs["audio"] = features.to(self.device)
        if text:
            inputs["text"] = self.tokenizer(list(prompts)).reshape(len(prompts), -1).to(self.device)
        return inputs

    @torch.no_grad()
    def embed(self, media: MediaBatch, prompts: list[str]) -> dict[str, torch.Tensor]:
        """L2-normalised float32 embeddings [B, D] per modality the mode uses ('vision', 'audio', 'text')."""
        outputs = self.model(self.inputs(media, prompts))
        embeddings = {name: F.normalize(out.float(), dim=-1) for name, out in outputs.items()}
        for name, emb in embeddings.items():
            if not torch.isfinite(emb).all():
                raise ValueError(f"reward 'imagebind': the model produced non-finite {name} embeddings")
        return embeddings

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor | RewardOutput:
        """Cosine [B] for a single mode; for 'all', RewardOutput(weighted mean, {component: cosine [B]})."""
        emb = self.embed(media, prompts)

        def cosine(a: str, b: str) -> torch.Tensor:
            return (emb[a] * emb[b]).sum(-1).clamp(-1.0, 1.0).cpu()

        if self.mode == "audio_video":
            return cosine("audio", "vision")
        if self.mode == "text_audio":
            return cosine("text", "audio")
        if self.mode == "text_video":
            return cosine("text", "vision")
        parts = {
            "audio_video": cosine("audio", "vision"),
            "text_audio": cosine("text", "audio"),
            "text_video": cosine("text", "vision"),
        }
        total = sum(self.weights.values())
        scores = sum(self.weights[name] / total * value for name, value in parts.items())
        return RewardOutput(scores=scores, components=parts)  # type: ignore[arg-type]
