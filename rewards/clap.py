"""CLAP text-audio reward: cosine of the L2-normalised text and audio embeddings of a CLAP model.

Two backends, chosen with `backend=`:

- "transformers" (default): transformers' `ClapModel` + `ClapProcessor`, loaded with `from_pretrained` from
  a local directory or a hub id (laion-clap is not used).
- "laion_clap": the `laion_clap` package (optional, `pip install laion-clap==1.1.7`) with a local LAION-CLAP
  `.pt` checkpoint; `amodel` ("HTSAT-tiny", "HTSAT-base", ...), `enable_fusion` and `tmodel` ("roberta")
  must match the checkpoint. laion_clap is imported only when this backend is chosen: it imports
  torchvision and loads tokenizers from the Hugging Face hub at import time (see `LAION_CLAP_PITFALLS`).

In a config, give the checkpoint (and backend) through `reward.options`:

    reward: {weights: {clap: 1.0}, options: {clap: {checkpoint: /models/clap-htsat-unfused}}}
    reward: {weights: {clap: 1.0}, options: {clap: {backend: laion_clap, checkpoint: /models/630k-best.pt}}}

In code, register a configured reward under a name of its own:

    import functools

    from omni_diffusion_rl.registry import rewards

from .clap_features import clap_input_features, repeat_pad
    from rewards.clap import ClapReward

    rewards.register("clap_htsat")(functools.partial(ClapReward, checkpoint="/models/clap-htsat-unfused"))

    # or, as a subclass:
    @rewards.register("clap_local")
    class LocalClap(ClapReward):
        def __init__(self) -> None:
            super().__init__(checkpoint="/models/clap-htsat-unfused", device="cuda")

Preprocessing is deterministic: mono mixdown, windowed-sinc resampling to the model's rate (48 kHz for the
LAION checkpoints), a centre crop of clips longer than the window (or than `max_seconds`), and repeat-padding
of shorter clips (CLAP's own "repeatpad": whole repeats, then zeros). No clip ever reaches the random-crop
or random-fusion code of the feature extractor or of laion-clap, which only run on clips over the window.
With laion-clap the waveform also takes the int16 round trip laion-clap applies when it loads audio files
or numpy arrays (clip to [-1, 1], quantise to 1/32767), unless `quantize=False`.
"""

from __future__ import annotations

import importlib
import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits
from rewards.clap_features import clap_input_features, repeat_pad

SINC_ZERO_CROSSINGS = 16  # half-width of the resampling filter, in zero crossings of its sinc
SINC_ROLLOFF = 0.95  # cutoff as a share of the lower Nyquist frequency, leaving room for the window


def resample(audio: torch.Tensor, orig_rate: int, new_rate: int) -> torch.Tensor:
    """Resample [..., S] from `orig_rate` to `new_rate` Hz with a Hann-windowed sinc filter (float64 on CPU).

    Linear interpolation would be simpler, but it has no low-pass filter: downsampling folds everything
    above the new Nyquist back into the band and upsampling leaves images of the spectrum. A windowed
    sinc is band-limited, and computed as a polyphase conv1d it is made only of deterministic torch ops.
    Output length: ceil(S * new_rate / orig_rate); the signal is taken as zero outside the clip.
    """
    if orig_rate <= 0 or new_rate <= 0:
        raise ValueError(f"sample rates must be positive; got {orig_rate} -> {new_rate}")
    shape = audio.shape
    x = audio.detach().to("cpu", torch.float64).reshape(-1, 1, shape[-1])
    if orig_rate == new_rate:
        return x.reshape(shape)
    g = math.gcd(int(orig_rate), int(new_rate))
    up, down = new_rate // g, orig_rate // g
    cutoff = SINC_ROLLOFF * min(1.0, up / down)  # in cycles per input sample, relative to input Nyquist
    half = math.ceil(SINC_ZERO_CROSSINGS / cutoff)  # filter half-width in input samples
    # Output q * up + r sits at input position q * down + r * down / up: phase r reads input samples
    # q * down + j for j in [-half, half + down] with weights h(r * down / up - j).
    taps = torch.arange(-half, half + down + 1, dtype=torch.float64)
    phases = torch.arange(up, dtype=torch.float64) * down / up
    dist = phases[:, None] - taps[None, :]
    window = torch.where(dist.abs() <= half, 0.5 * (1.0 + torch.cos(math.pi * dist / half)), 0.0)
    kernel = (cutoff * torch.sinc(cutoff * dist) * window).unsqueeze(1)  # [up, 1, taps]
    padded = F.pad(x, (half, half + down))
    out = F.conv1d(padded, kernel, stride=down)  # [N, up, ceil(S / down)]
    out = out.transpose(1, 2).reshape(x.shape[0], -1)[:, : math.ceil(shape[-1] * up / down)]
    return out.reshape(*shape[:-1], out.shape[-1])


def centre_crop(audio: torch.Tensor, length: int) -> torch.Tensor:
    """The middle `length` samples of [..., S] (unchanged when S <= length)."""
    extra = audio.shape[-1] - length
    return audio if extra <= 0 else audio[..., extra // 2 : extra // 2 + length]


def int16_round_trip(audio: torch.Tensor) -> torch.Tensor:
    """laion-clap's float32 -> int16 -> float32 quantisation: clip to [-1, 1], scale by 32767, truncate to 0.

    laion-clap applies it to audio files and numpy arrays but not to tensors (`use_tensor=True`); its README
    example quantises tensors by hand first, as this reward does (`quantize=True`).
    """
    ints = (audio.to(torch.float32).clamp(-1.0, 1.0) * 32767.0).to(torch.int16)
    return ints.to(torch.float32) / 32767.0


def _is_local_path(checkpoint: str | os.PathLike[str]) -> bool:
    text = os.fspath(checkpoint)
    return (
        not isinstance(checkpoint, str)
        or os.path.isabs(text)
        or text.startswith(("~", "."))
        or text.count("/") > 1
        or os.path.exists(text)
    )


def _check_tokenizer(tokenizer: Any, source: str) -> None:
    """Raise if the tokenizer is missing or has an empty vocabulary (offline hub ids can give one)."""
    if tokenizer is None:
        raise ValueError(f"CLAP reward: the processor from {source} has no tokenizer")
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", 0)
    if not size:
        raise ValueError(
            f"CLAP reward: the tokenizer from {source} has an empty vocabulary; with HF_HUB_OFFLINE=1 an "
            "uncached hub id can load this way. Pass a local checkpoint directory that holds the tokenizer."
        )


def _embedding(output: Any) -> torch.Tensor:
    """get_*_features returns a tensor in older transformers and a pooled model output in newer ones."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output


BACKENDS = ("transformers", "laion_clap")
LAION_CLAP_INSTALL = "pip install laion-clap==1.1.7"
LAION_CLAP_SAMPLE_RATE = 48_000  # the rate of every laion-clap 1.1.7 model config
LAION_CLAP_WINDOW = 480_000  # CLAP_Module.get_audio_embedding_from_data crops or pads every clip to this
LAION_CLAP_TMODELS = ("roberta",)  # CLAP_Module always tokenises with roberta-base, whatever its tmodel
LAION_CLAP_PITFALLS = (
    "laion-clap imports torchvision without declaring it (a torchvision wheel from PyPI can replace a CPU "
    "torch with a CUDA build, and one that does not match torch fails to import); at import and in "
    "CLAP_Module() it loads the bert-base-uncased, roberta-base and facebook/bart-base tokenizers from the "
    "Hugging Face hub, so their files must be in the HF cache, and without internet HF_HUB_OFFLINE=1 must be "
    "set or the import hangs (with it, an uncached tokenizer loads silently empty); it declares numpy<2; "
    "fusion checkpoints (enable_fusion=True) also need torchaudio"
)


def _laion_error(e: BaseException) -> str:
    return (
        f"reward 'clap' with backend 'laion_clap' needs the laion_clap package, which could not be imported "
        f"({type(e).__name__}: {e}). Install it with `{LAION_CLAP_INSTALL}`. Known pitfalls: "
        f"{LAION_CLAP_PITFALLS}. Or use the default backend='transformers' with a transformers CLAP "
        "checkpoint directory (e.g. a local copy of laion/clap-htsat-unfused), which needs none of this."
    )


def _import_laion_clap(enable_fusion: bool) -> Any:
    """The laion_clap module, or an ImportError that says how to install it and what goes wrong."""
    try:
        laion_clap = importlib.import_module("laion_clap")
    except Exception as e:  # ImportError, torchvision's RuntimeError next to a mismatched torch, hub errors
        raise ImportError(_laion_error(e)) from e
    if enable_fusion:
        data = importlib.import_module("laion_clap.training.data")
        if getattr(data, "torchaudio", None) is None:
            raise ImportError(
                "reward 'clap' with backend 'laion_clap' and enable_fusion=True needs torchaudio: laion-clap "
                "computes the mel spectrograms of fusion models with torchaudio.transforms.MelSpectrogram. "
                "Install a torchaudio that matches torch, use a non-fusion checkpoint, or use "
                "backend='transformers'."
            )
    return laion_clap


def _load_laion_clap(
    checkpoint: str | os.PathLike[str], amodel: str, enable_fusion: bool, tmodel: str, device: torch.device
) -> Any:
    """A `laion_clap.CLAP_Module` with the weights of a local checkpoint file (never downloaded)."""
    path = os.path.expanduser(os.fspath(checkpoint))
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"reward 'clap' (backend 'laion_clap'): checkpoint file '{path}' does not exist; pass the local "
            "path of a LAION-CLAP .pt checkpoint (e.g. 630k-audioset-best.pt)"
        )
    laion_clap = _import_laion_clap(enable_fusion)
    try:
        model = laion_clap.CLAP_Module(
            enable_fusion=enable_fusion, device=str(device), amodel=amodel, tmodel=tmodel
        )
    except Exception as e:
        raise OSError(
            f"reward 'clap' (backend 'laion_clap'): could not build CLAP_Module(amodel={amodel!r}, "
            f"enable_fusion={enable_fusion}, tmodel={tmodel!r}) ({type(e).__name__}: {e}); known pitfalls: "
            f"{LAION_CLAP_PITFALLS}"
        ) from e
    _check_laion_tokenizer(getattr(model, "tokenize", None))
    try:
        model.load_ckpt(path, verbose=False)
    except Exception as e:
        raise OSError(
            f"reward 'clap' (backend 'laion_clap'): could not load checkpoint '{path}' into "
            f"CLAP_Module(amodel={amodel!r}, enable_fusion={enable_fusion}) ({type(e).__name__}: {e}); "
            "amodel and enable_fusion must match the checkpoint (the *fusion* checkpoints need "
            "enable_fusion=True, the music ones amodel='HTSAT-base')"
        ) from e
    return model


def _check_laion_tokenizer(tokenizer: Any) -> None:
    """Raise if CLAP_Module's roberta-base tokenizer is missing or has no vocabulary beyond special tokens.

    With HF_HUB_OFFLINE=1 an uncached tokenizer loads with only its special tokens (vocab_size 5).
    """
    size = getattr(tokenizer, "vocab_size", 0) if tokenizer is not None else 0
    specials = len(set(getattr(tokenizer, "all_special_tokens", None) or []))
    if size <= specials:
        raise OSError(
            "reward 'clap' (backend 'laion_clap'): laion-clap's roberta-base tokenizer is missing or empty "
            f"(vocab_size {size}); its files must be in the Hugging Face cache (with HF_HUB_OFFLINE=1 an "
            "uncached tokenizer loads silently empty)"
        )


def _cosine(audio_emb: Any, text_emb: Any, batch: int) -> torch.Tensor:
    """Row-wise cosine of two [B, D] embeddings as float32 on the CPU, clamped to [-1, 1]."""
    audio_emb = torch.as_tensor(audio_emb)
    text_emb = torch.as_tensor(text_emb)
    if audio_emb.dim() != 2 or audio_emb.shape != text_emb.shape or len(audio_emb) != batch:
        raise ValueError(
            f"reward 'clap': expected audio and text embeddings of shape [{batch}, D]; got "
            f"{tuple(audio_emb.shape)} and {tuple(text_emb.shape)}"
        )
    audio_emb = F.normalize(audio_emb.float(), dim=-1)
    text_emb = F.normalize(text_emb.float(), dim=-1)
    scores = (audio_emb * text_emb).sum(-1).clamp(-1.0, 1.0).cpu()
    if not torch.isfinite(scores).all():
        raise ValueError("reward 'clap': the model produced non-finite embeddings")
    return scores


@rewards.register("clap")
class ClapReward:
    """Text-audio cosine in [-1, 1] from a CLAP model; one score per (audio, prompt) pair.

    backend: "transformers" (default) or "laion_clap".
    checkpoint: for "transformers", a local directory or hub id for `ClapModel`/`ClapProcessor`'s
    `from_pretrained`; for "laion_clap", a local LAION-CLAP `.pt` file.
    model, processor: ready-made objects instead (for "transformers" a processor is still loaded from
    `checkpoint` if omitted). For "laion_clap", `model` is a `laion_clap.CLAP_Module` or any object with its
    `get_audio_embedding_from_data(x=, use_tensor=)` and `get_text_embedding(texts, use_tensor=)` methods.
    max_seconds: score at most this much of each clip (centre crop); defaults to the model's window
    (10 s for the LAION checkpoints) and may not exceed it.
    amodel, enable_fusion, tmodel, quantize ("laion_clap" only): the audio encoder ("HTSAT-tiny" by default),
    whether the checkpoint is a fusion one (False), the text encoder ("roberta", the only one CLAP_Module
    tokenises for) and whether to apply laion-clap's int16 round trip to the waveform (True).
    """

    # It resamples each whole clip (then hears a centre crop of its window) and reads no video.
    input_limits = InputLimits(
        frames=2048,
        frame_height=4096,
        frame_width=4096,
        audio_samples=2 * 48_000 * 600,
        meant_for="CLAP hears at most a 10 s window of each clip and reads no video: up to 10 minutes of "
        "stereo 48 kHz audio, video up to 2048 frames of 4096 x 4096",
    )
    modality = "audio"

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        model: Any = None,
        processor: Any = None,
        max_seconds: float | None = None,
        backend: str = "transformers",
        amodel: str | None = None,
        enable_fusion: bool | None = None,
        tmodel: str | None = None,
        quantize: bool | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(
                f"reward 'clap': unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}"
            )
        for name, flag in (("enable_fusion", enable_fusion), ("quantize", quantize)):
            if flag is not None and not isinstance(flag, bool):
                raise ValueError(f"reward 'clap': {name} must be true or false; got {flag!r}")
        self.backend = backend
        self.device = torch.device(device)
        if backend == "laion_clap":
            self._init_laion_clap(
                checkpoint,
                model,
                processor,
                amodel="HTSAT-tiny" if amodel is None else amodel,
                enable_fusion=bool(enable_fusion),
                tmodel="roberta" if tmodel is None else tmodel,
                quantize=True if quantize is None else quantize,
            )
        else:
            laion_only = {
                "amodel": amodel,
                "enable_fusion": enable_fusion,
                "tmodel": tmodel,
                "quantize": quantize,
            }
            given = [name for name, value in laion_only.items() if value is not None]
            if given:
                raise ValueError(
                    f"reward 'clap': option(s) {', '.join(given)} only apply to backend='laion_clap'; "
                    "the transformers backend reads them from its checkpoint"
                )
            self._init_transformers(checkpoint, model, processor)
        window_seconds = self.window / self.sample_rate
        if max_seconds is not None and not 0 < max_seconds <= window_seconds:
            raise ValueError(
                f"reward 'clap': max_seconds must be in (0, {window_seconds:g}] (the model's window); "
                f"got {max_seconds}"
            )
        self.max_samples = (
            self.window if max_seconds is None else max(1, round(max_seconds * self.sample_rate))
        )

    def _init_transformers(
        self, checkpoint: str | os.PathLike[str] | None, model: Any, processor: Any
    ) -> None:
        if model is None and checkpoint is None:
            raise ValueError(
                "reward 'clap' needs a CLAP checkpoint: set reward.options={clap: {checkpoint: <local "
                "directory or hub id>}} in the config, or in code pass checkpoint= (or a model and "
                "processor); see rewards/clap.py"
            )
        source = "the given processor" if processor is not None else f"checkpoint '{checkpoint}'"
        if processor is None and checkpoint is None:
            raise ValueError("reward 'clap': a model without a processor also needs checkpoint= for one")
        if checkpoint is not None and (model is None or processor is None):
            model, processor = self._load(checkpoint, model, processor)
        _check_tokenizer(getattr(processor, "tokenizer", None), source)
        self.processor = processor
        self.feature_extractor = processor.feature_extractor
        self.model = model.to(self.device).eval()
        self.sample_rate = int(self.feature_extractor.sampling_rate)
        self.window = int(self.feature_extractor.nb_max_samples)
        audio_config = getattr(self.model.config, "audio_config", None)
        # Both modes only crop at random when a clip is longer than the window, which never happens here;
        # the mode must match the model: fusion models take 4 stacked mels, the others one.
        self.truncation = "fusion" if getattr(audio_config, "enable_fusion", False) else "rand_trunc"

    def _init_laion_clap(
        self,
        checkpoint: str | os.PathLike[str] | None,
        model: Any,
        processor: Any,
        amodel: str,
        enable_fusion: bool,
        tmodel: str,
        quantize: bool,
    ) -> None:
        if processor is not None:
            raise ValueError(
                "reward 'clap': processor= is for backend='transformers'; laion-clap makes its own features"
            )
        if tmodel not in LAION_CLAP_TMODELS:
            raise ValueError(
                f"reward 'clap' (backend 'laion_clap'): tmodel must be one of {LAION_CLAP_TMODELS}; got "
                f"{tmodel!r} (CLAP_Module always tokenises prompts with roberta-base)"
            )
        if (model is None) == (checkpoint is None):
            raise ValueError(
                "reward 'clap' with backend 'laion_clap' needs exactly one of checkpoint= (a local "
                "LAION-CLAP .pt file, e.g. reward.options={clap: {backend: laion_clap, checkpoint: "
                "/models/630k-best.pt}}) or model= (a laion_clap.CLAP_Module)"
            )
        if model is None:
            model = _load_laion_clap(checkpoint, amodel, enable_fusion, tmodel, self.device)
        elif isinstance(model, torch.nn.Module):
            model = model.to(self.device).eval()
        missing = [
            name
            for name in ("get_audio_embedding_from_data", "get_text_embedding")
            if not callable(getattr(model, name, None))
        ]
        if missing:
            raise TypeError(
                f"reward 'clap' (backend 'laion_clap'): the model has no {' or '.join(missing)} method; "
                "pass a laion_clap.CLAP_Module"
            )
        self.model = model
        self.processor = None
        self.quantize = quantize
        audio_cfg = (getattr(model, "model_cfg", None) or {}).get("audio_cfg", {})
        self.sample_rate = int(audio_cfg.get("sample_rate", LAION_CLAP_SAMPLE_RATE))
        self.window = LAION_CLAP_WINDOW

    @staticmethod
    def _load(checkpoint: str | os.PathLike[str], model: Any, processor: Any) -> tuple[Any, Any]:
        from transformers import ClapModel, ClapProcessor

        path = os.path.expanduser(os.fspath(checkpoint))
        if _is_local_path(checkpoint) and not os.path.isdir(path):
            raise FileNotFoundError(
                f"reward 'clap': checkpoint directory '{path}' does not exist; pass a local directory "
                "saved with save_pretrained, or a hub id"
            )
        try:
            if processor is None:
                processor = ClapProcessor.from_pretrained(path)
            if model is None:
                model = ClapModel.from_pretrained(path)
        except Exception as e:
            raise OSError(
                f"reward 'clap': could not load a CLAP model/processor from '{path}' "
                f"({type(e).__name__}: {e}); "
                "pass a local checkpoint directory, or a hub id that is cached when HF_HUB_OFFLINE=1"
            ) from e
        return model, processor

    def _mono(self, media: MediaBatch) -> torch.Tensor:
        """Checked mono audio at the model's rate, centre-cropped to `max_samples`: float [B, S], CPU
        (float32 at the model's rate already, float64 when resampled)."""
        if media.audio is None:
            raise ValueError("reward 'clap' needs audio; the media batch has none")
        audio = media.audio
        if audio.shape[-1] == 0:
            raise ValueError("reward 'clap': the audio clips are empty (0 samples)")
        if not torch.isfinite(audio).all():
            bad = (~torch.isfinite(audio)).flatten(1).any(1).nonzero().flatten().tolist()
            raise ValueError(f"reward 'clap': audio has non-finite values (NaN/inf) in samples {bad}")
        if int(media.sample_rate) == self.sample_rate:
            return centre_crop(audio.detach().to("cpu", torch.float32).mean(dim=1), self.max_samples)
        mono = audio.detach().to("cpu", torch.float64).mean(dim=1)
        return centre_crop(resample(mono, int(media.sample_rate), self.sample_rate), self.max_samples)

    def preprocess(self, media: MediaBatch) -> dict[str, torch.Tensor]:
        """Keyword arguments of the model's audio embedding call: mono, resampled, cropped, padded.

        transformers: the feature extractor's mels, is_longer False. laion_clap: `x`, the float32 waveforms
        [B, 480000] at 48 kHz, already repeat-padded to the window (so laion-clap neither crops nor pads).
        """
        mono = self._mono(media)
        if self.backend == "laion_clap":
            audio = int16_round_trip(mono) if self.quantize else mono.to(torch.float32)
            return {"x": repeat_pad(audio, self.window).to(self.device)}
        # The extractor's own mels, computed for the whole batch at once (rewards/clap_features.py); no clip
        # is longer than the window, so is_longer is False (the extractor would flag one at random).
        features = clap_input_features(mono, self.feature_extractor, fusion=self.truncation == "fusion")
        is_longer = torch.zeros(len(mono), 1, dtype=torch.bool)
        return {"input_features": features.to(self.device), "is_longer": is_longer.to(self.device)}

    def tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask, padded to the longest prompt and truncated to the model's limit."""
        if self.backend == "laion_clap":
            raise NotImplementedError("reward 'clap': laion-clap tokenises prompts inside get_text_embedding")
        tokens = self.processor.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
        return {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}

    def embed(self, media: MediaBatch, prompts: Sequence[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's audio and text embeddings [B, D] (not yet normalised here)."""
        features = self.preprocess(media)
        if self.backend == "laion_clap":
            audio_emb = self.model.get_audio_embedding_from_data(**features, use_tensor=True)
            text_emb = self.model.get_text_embedding(list(prompts), use_tensor=True)
            return torch.as_tensor(audio_emb), torch.as_tensor(text_emb)
        audio_emb = _embedding(self.model.get_audio_features(**features))
        text_emb = _embedding(self.model.get_text_features(**self.tokenize(list(prompts))))
        return audio_emb, text_emb

    @torch.no_grad()
    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        """Cosine of each clip's audio embedding with its prompt's text embedding: float tensor [B]."""
        if len(prompts) != len(media):
            raise ValueError(f"reward 'clap': {len(prompts)} prompts for {len(media)} media samples")
        return _cosine(*self.embed(media, prompts), batch=len(media))
