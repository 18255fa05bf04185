"""The tiny omni language model: a small Qwen2 causal LM (transformers) that reads a clip's frames and
sound through two small encoders whose outputs enter the LM as input embeddings, as omni models do.

Sequence layout, one row per sample, left-padded: [pad ... | media (video frames, then audio frames)
| question tokens | answer tokens]. The video encoder turns each frame into one embedding (a strided
convolution), the audio encoder each of the clip's audio frames (a log-magnitude STFT of the
waveform, projected); a learned type embedding marks each. The tokenizer is word-level
(`tokenizers`), saved with the model, so `AutoTokenizer.from_pretrained(path / "tokenizer")` loads it.

Saved layout (`save_pretrained`): `omni_config.json`, `lm/` (transformers), `tokenizer/`,
`media_encoder.safetensors`. Nothing is unpickled; JSON reads are bounded.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..answer_data.clip_files import ClipFormat
from ..answer_data.questions import AskedQuestion
from ..world.tiny_clip import AUDIO_FRAMES, DURATION_S, FPS, SAMPLE_RATE, VIDEO_FRAMES, VIDEO_SIZE

PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
SPECIALS = (PAD, EOS, UNK)
CONFIG_NAME, ENCODER_NAME = "omni_config.json", "media_encoder.safetensors"
FORMAT = 1
OMNI_BASE = Path(__file__).resolve().parent.parent / "assets" / "tiny_omni_base"
"""The shipped supervised base (`odrl pretrain --omni`); `pretrained: builtin-omni` names it."""
MAX_CONFIG_BYTES = 1 << 20
N_FFT = 256
HOP = int(SAMPLE_RATE * DURATION_S) // AUDIO_FRAMES  # one STFT frame per audio frame


def build_tokenizer(words: list[str]) -> Any:
    """A word-level fast tokenizer over `words` (specials first: pad 0, eos 1, unk 2)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate([*SPECIALS, *words])}
    core = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token=PAD, eos_token=EOS, unk_token=UNK)


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's word -> id map: a checkpoint with another vocabulary is refused."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab).encode()).hexdigest()


@dataclass(frozen=True)
class TinyOmniConfig:
    hidden_size: int = 192
    layers: int = 4
    heads: int = 6
    kv_heads: int = 2
    intermediate_size: int = 512
    max_positions: int = 96
    video_channels: int = 16

    def lm_config(self, vocab_size: int) -> Any:
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=self.max_positions,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )


class MediaEncoder(nn.Module):
    """Video [B, F, 3, H, W] in [0, 1] and waveform [B, 1, S] -> [B, F + AUDIO_FRAMES, hidden]."""

    def __init__(self, hidden: int, channels: int) -> None:
        super().__init__()
        self.frame = nn.Conv2d(3, channels, kernel_size=4, stride=4)
        self.video_proj = nn.Linear(channels * (VIDEO_SIZE // 4) ** 2, hidden)
        self.audio_proj = nn.Linear(N_FFT // 2 + 1, hidden)
        self.types = nn.Parameter(torch.zeros(2, hidden))
        self.register_buffer("window", torch.hann_window(N_FFT), persistent=False)

    @property
    def num_tokens(self) -> int:
        return VIDEO_FRAMES + AUDIO_FRAMES

    def forward(self, video: torch.Tensor, waveform: torch.Tensor) -> torch.Tensor:
        b, f = video.shape[:2]
        if f != VIDEO_FRAMES or tuple(video.shape[2:]) != (3, VIDEO_SIZE, VIDEO_SIZE):
            raise ValueError(
                f"video {tuple(video.shape)}: the tiny omni model reads [B, {VIDEO_FRAMES}, 3, {VIDEO_SIZE}, "
                f"{VIDEO_SIZE}] clips"
            )
        frames = torch.nn.functional.gelu(self.frame(video.flatten(0, 1) * 2 - 1)).flatten(1)
        v = self.video_proj(frames).view(b, f, -1) + self.types[0]
        spec = torch.stft(
            waveform.flatten(1).float(),
            N_FFT,
            hop_length=HOP,
            window=self.window,
            center=True,
            return_complex=True,
        ).abs()  # [B, freqs, frames]
        a = self.audio_proj(torch.log1p(spec[..., :AUDIO_FRAMES].transpose(1, 2) * 10)) + self.types[1]
        return torch.cat([v, a], dim=1)


@dataclass
class Prompted:
    """Left-padded model inputs of a batch: embeddings [B, P, H], attention mask [B, P], positions."""

    embeds: torch.Tensor
    mask: torch.Tensor

    @property
    def positions(self) -> torch.Tensor:
        return (self.mask.long().cumsum(-1) - 1).clamp(min=0)

    def repeated(self, k: int) -> Prompted:
        """Each prompt k times in a row (a group's answers to one question about one clip)."""
        return self.rows(torch.arange(len(self.embeds)).repeat_interleave(k))

    def rows(self, index: torch.Tensor) -> Prompted:
        """The prompts `index` names (repeats allowed), gradients flowing through the selection."""
        at = index.to(self.embeds.device)
        return Prompted(self.embeds[at], self.mask[at])


class TinyOmniModel(nn.Module):
    """The LM and its media encoder; `tokenizer` is attached (not a module)."""

    def __init__(self, config: TinyOmniConfig, tokenizer: Any) -> None:
        super().__init__()
        from transformers import Qwen2ForCausalLM

        self.omni_config = config
        self.tokenizer = tokenizer
        self.lm = Qwen2ForCausalLM(config.lm_config(len(tokenizer.get_vocab())))
        self.encoder = MediaEncoder(config.hidden_size, config.video_channels)

    @property
    def config(self) -> dict[str, Any]:
        """The model's identity for checkpoint fingerprints: its sizes and its vocabulary."""
        return {**asdict(self.omni_config), "vocabulary": vocabulary_fingerprint(self.tokenizer)}

    @property
    def media_tokens(self) -> int:
        """Positions a prompt takes besides its question (the media embeddings)."""
        return self.encoder.num_tokens

    def sampling_options(self, prompted: Prompted) -> dict[str, Any]:
        """Nothing besides the embeddings: `sample_answers`' default positions are the prompt's."""
        return {}

    @property
    def eos_id(self) -> int:
        return int(self.tokenizer.eos_token_id)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Word ids of each text (no specials); an unknown word is refused by name."""
        unk = self.tokenizer.unk_token_id
        out = []
        for text in texts:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if unk in ids:
                words = [w for w, i in zip(text.split(), ids, strict=False) if i == unk]
                raise ValueError(f"the tiny omni tokenizer does not know {words} (in {text!r})")
            out.append(ids)
        return out

    @property
    def clip_format(self) -> ClipFormat:
        """The clips the model reads: the tiny clip's frame rate, sample rate, length and frame size, mono."""
        return ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (VIDEO_SIZE, VIDEO_SIZE))

    def clip_tensors(self, asked: list[AskedQuestion]) -> tuple[torch.Tensor, torch.Tensor]:
        """Video [B, F, 3, H, W] and waveforms [B, 1, S] of asked questions, as `prompt` takes them:
        frames resized to the model's size (antialiased bilinear) when they differ, and a missing
        picture or sound given as black frames or silence."""
        videos, sounds = [], []
        for q in asked:
            video = torch.zeros(VIDEO_FRAMES, 3, VIDEO_SIZE, VIDEO_SIZE) if q.video is None else q.video
            if tuple(video.shape[-2:]) != (VIDEO_SIZE, VIDEO_SIZE):
                size = (VIDEO_SIZE, VIDEO_SIZE)
                video = torch.nn.functional.interpolate(video, size, mode="bilinear", antialias=True)
            videos.append(video.clamp(0, 1))
            samples = int(SAMPLE_RATE * DURATION_S)
            sounds.append(torch.zeros(1, samples) if q.audio is None else q.audio)
        return torch.stack(videos), torch.stack(sounds)

    def prompt(self, video: torch.Tensor, waveform: torch.Tensor, questions: list[list[int]]) -> Prompted:
        """[pad | media | question] embeddings of a batch, left-padded to one length."""
        media = self.encoder(video, waveform)
        width = media.shape[1] + max(len(q) for q in questions)
        embed = self.lm.get_input_embeddings()
        rows, masks = [], []
        for m, q in zip(media, questions, strict=True):
            ids = torch.tensor(q, dtype=torch.long, device=m.device)
            body = torch.cat([m, embed(ids)])
            pad = width - len(body)
            rows.append(torch.cat([body.new_zeros(pad, body.shape[1]), body]))
            masks.append(torch.cat([torch.zeros(pad), torch.ones(len(body))]).long())
        return Prompted(torch.stack(rows), torch.stack(masks).to(media.device))

    def answer_log_probs(
        self,
        prompted: Prompted,
        answers: torch.Tensor,
        answer_mask: torch.Tensor,
        temperature: float = 1.0,
        min_new_tokens: int = 0,
    ) -> torch.Tensor:
        """[B, L] log pi(answer token | clip, question, answer so far), teacher-forced in one pass
        (what the trainer recomputes; padding after an answer is masked out of attention), under the
        sampler's distribution: the end token is excluded before `min_new_tokens` tokens, as it was
        when the answers were sampled."""
        from ..experience.text_sampling import token_log_probs

        embeds = torch.cat([prompted.embeds, self.lm.get_input_embeddings()(answers)], dim=1)
        mask = torch.cat([prompted.mask, answer_mask.long()], dim=1)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.lm(inputs_embeds=embeds, attention_mask=mask, position_ids=positions).logits
        p = prompted.embeds.shape[1]
        logits = logits[:, p - 1 : -1].float()
        if min_new_tokens > 0:
            logits[:, :min_new_tokens, self.eos_id] = float("-inf")
        return token_log_probs(logits, answers, temperature)

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        self.lm.save_pretrained(path / "lm", safe_serialization=True)
        self.tokenizer.save_pretrained(path / "tokenizer")
        state = {k: v.detach().cpu().contiguous() for k, v in self.encoder.state_dict().items()}
        save_file(state, str(path / ENCODER_NAME))
        vocabulary = vocabulary_fingerprint(self.tokenizer)
        meta = {"format": FORMAT, "config": asdict(self.omni_config), "vocabulary": vocabulary}
        (path / CONFIG_NAME).write_text(json.dumps(meta, indent=1))

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TinyOmniModel:
        """A directory written by save_pretrained; a missing part or a tokenizer that is not the one
        the model was saved with is refused by name."""
        from safetensors.torch import load_file
        from transformers import AutoTokenizer, Qwen2ForCausalLM

        from ..checkpoint import read_bounded

        path = OMNI_BASE if str(path) == "builtin-omni" else Path(path)
        missing = [
            n
            for n in (CONFIG_NAME, "lm/config.json", "tokenizer/tokenizer.json", ENCODER_NAME)
            if not (path / n).is_file()
        ]
        if missing:
            hint = " Run `odrl pretrain --omni` to create it." if path == OMNI_BASE else ""
            raise FileNotFoundError(f"no tiny omni model at {path}: missing {', '.join(missing)}.{hint}")
        meta = json.loads(read_bounded(path / CONFIG_NAME, MAX_CONFIG_BYTES))
        config = meta.get("config") if isinstance(meta, dict) else None
        if not isinstance(config, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"{path / CONFIG_NAME}: not a tiny omni model config (format {FORMAT})")
        unknown = sorted(set(config) - set(TinyOmniConfig.__dataclass_fields__))
        if unknown:
            raise ValueError(f"{path / CONFIG_NAME}: unknown keys {unknown} in the model config")
        tokenizer = AutoTokenizer.from_pretrained(str(path / "tokenizer"))
        if vocabulary_fingerprint(tokenizer) != meta.get("vocabulary"):
            raise ValueError(
                f"{path / 'tokenizer'}: this tokenizer's vocabulary is not the one the model was saved with"
            )
        model = cls(TinyOmniConfig(**config), tokenizer)
        model.lm = Qwen2ForCausalLM.from_pretrained(str(path / "lm"), use_safetensors=True)
        if model.lm.config.hidden_size != model.omni_config.hidden_size:
            raise ValueError(
                f"{path}: the LM's width {model.lm.config.hidden_size} is not the media encoder's "
                f"{model.omni_config.hidden_size} ({CONFIG_NAME})"
            )
        if model.lm.config.vocab_size != len(tokenizer.get_vocab()):
            raise ValueError(
                f"{path}: the LM has {model.lm.config.vocab_size} token embeddings, the tokenizer "
                f"{len(tokenizer.get_vocab())} words"
            )
        model.encoder.load_state_dict(load_file(str(path / ENCODER_NAME)))
        return model


class TinyOmniPolicy:
    """The tiny omni model as the trainer's policy: LoRA goes into the whole model's attention
    projections (the LM's; the media encoders stay frozen), `model` answers, `tokenizer` decodes."""

    kind = "answers"  # an autoregressive answering policy (the diffusion policies have no `kind`)
    lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, model: TinyOmniModel) -> None:
        self.model = model.requires_grad_(False)
        self.transformer = model  # what LoRA, the fingerprint and the optimizer see
        self.tokenizer = model.tokenizer

    @classmethod
    def from_pretrained(cls, path: str | Path = "builtin-omni") -> TinyOmniPolicy:
        return cls(TinyOmniModel.from_pretrained(path))

    def to(self, device: torch.device | str) -> TinyOmniPolicy:
        self.model.to(device)
        return self
