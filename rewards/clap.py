"""CLAP text-audio reward: cosine of the L2-normalised text and audio embeddings of a CLAP model.

The default backend is transformers' `ClapModel` + `ClapProcessor`, loaded with `from_pretrained` from a
local directory or a hub id (laion-clap is not used). In a config, give the checkpoint through
`reward.options`:

    reward: {weights: {clap: 1.0}, options: {clap: {checkpoint: /models/clap-htsat-unfused}}}

In code, register a configured reward under a name of its own:

    import functools

    from omni_diffusion_rl.registry import rewards
    from rewards.clap import ClapReward

    rewards.register("clap_htsat")(functools.partial(ClapReward, checkpoint="/models/clap-htsat-unfused"))

    # or, as a subclass:
    @rewards.register("clap_local")
    class LocalClap(ClapReward):
        def __init__(self) -> None:
            super().__init__(checkpoint="/models/clap-htsat-unfused", device="cuda")

Preprocessing is deterministic: mono mixdown, windowed-sinc resampling to the feature extractor's rate,
a centre crop of clips longer than the window (or than `max_seconds`), and CLAP's own repeat-padding of
shorter clips. No clip ever reaches the feature extractor's random-crop or random-fusion code.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.nn.functional as F

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards

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


@rewards.register("clap")
class ClapReward:
    """Text-audio cosine in [-1, 1] from a transformers CLAP model; one score per (audio, prompt) pair.

    checkpoint: local directory or hub id for `ClapModel`/`ClapProcessor.from_pretrained`.
    model, processor: ready-made objects instead (a processor is still loaded from `checkpoint` if omitted).
    max_seconds: score at most this much of each clip (centre crop); defaults to the model's window
    (10 s for the LAION checkpoints) and may not exceed it.
    """

    def __init__(
        self,
        checkpoint: str | os.PathLike[str] | None = None,
        device: str = "cpu",
        model: Any = None,
        processor: Any = None,
        max_seconds: float | None = None,
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
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.sample_rate = int(self.feature_extractor.sampling_rate)
        self.window = int(self.feature_extractor.nb_max_samples)
        window_seconds = self.window / self.sample_rate
        if max_seconds is not None and not 0 < max_seconds <= window_seconds:
            raise ValueError(
                f"reward 'clap': max_seconds must be in (0, {window_seconds:g}] (the model's window); "
                f"got {max_seconds}"
            )
        self.max_samples = (
            self.window if max_seconds is None else max(1, round(max_seconds * self.sample_rate))
        )
        audio_config = getattr(self.model.config, "audio_config", None)
        # Both modes only crop at random when a clip is longer than the window, which never happens here;
        # the mode must match the model: fusion models take 4 stacked mels, the others one.
        self.truncation = "fusion" if getattr(audio_config, "enable_fusion", False) else "rand_trunc"

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

    def preprocess(self, media: MediaBatch) -> dict[str, torch.Tensor]:
        """Audio features for the model: mono, resampled, centre-cropped, repeat-padded, is_longer False."""
        if media.audio is None:
            raise ValueError("reward 'clap' needs audio; the media batch has none")
        audio = media.audio
        if audio.shape[-1] == 0:
            raise ValueError("reward 'clap': the audio clips are empty (0 samples)")
        if not torch.isfinite(audio).all():
            bad = (~torch.isfinite(audio)).flatten(1).any(1).nonzero().flatten().tolist()
            raise ValueError(f"reward 'clap': audio has non-finite values (NaN/inf) in samples {bad}")
        mono = audio.detach().to("cpu", torch.float64).mean(dim=1)
        mono = centre_crop(resample(mono, int(media.sample_rate), self.sample_rate), self.max_samples)
        features = self.feature_extractor(
            list(mono.numpy()),
            sampling_rate=self.sample_rate,
            truncation=self.truncation,
            padding="repeatpad",
            return_tensors="pt",
        )
        # The extractor flags one random clip as "longer" in fusion mode when none is; none is here.
        features["is_longer"] = torch.zeros(len(mono), 1, dtype=torch.bool)
        return {k: v.to(self.device) for k, v in features.items()}

    def tokenize(self, prompts: list[str]) -> dict[str, torch.Tensor]:
        """Token ids and attention mask, padded to the longest prompt and truncated to the model's limit."""
        tokens = self.processor.tokenizer(prompts, padding=True, truncation=True, return_tensors="pt")
        return {k: v.to(self.device) for k, v in tokens.items() if k in ("input_ids", "attention_mask")}

    @torch.no_grad()
    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        """Cosine of each clip's audio embedding with its prompt's text embedding: float tensor [B]."""
        if len(prompts) != len(media):
            raise ValueError(f"reward 'clap': {len(prompts)} prompts for {len(media)} media samples")
        features = self.preprocess(media)
        audio_emb = _embedding(self.model.get_audio_features(**features))
        text_emb = _embedding(self.model.get_text_features(**self.tokenize(prompts)))
        audio_emb = F.normalize(audio_emb.float(), dim=-1)
        text_emb = F.normalize(text_emb.float(), dim=-1)
        scores = (audio_emb * text_emb).sum(-1).clamp(-1.0, 1.0).cpu()
        if not torch.isfinite(scores).all():
            raise ValueError("reward 'clap': the model produced non-finite embeddings")
        return scores
