"""The built-in tiny text-to-audio-video flow transformer and its policy.

One packed latent per sample (video patches + audio frames) is split into tokens, attended
jointly with the prompt's word tokens, and modulated by the timestep (adaLN-Zero, as in DiT).
"""

from __future__ import annotations

import math
import re
import warnings
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..media import MediaBatch
from ..world import tiny_clip as clip
from .policy import Condition

DEFAULT_LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out", "ff_in", "ff_out"]
BUILTIN_WEIGHTS = Path(__file__).resolve().parent.parent / "assets" / "tiny_av_base"
TEACHER_WEIGHTS = BUILTIN_WEIGHTS.parent / "tiny_av_teacher"
"""The shipped tiny teacher (`odrl pretrain --teacher`): larger, trained on clean labels."""
TEACHER_GUIDANCE = 3.0
"""The tiny teacher's recommended classifier-free guidance, which `odrl pretrain --teacher` writes to
its folder (guidance.json) and teacher 'policy' uses when none is given: measured (docs/algorithms.md),
after 6,000 pretraining steps held-out all four right 0.766 unguided, 0.883 at 2, 0.906 at 3, 0.902
at 4; the shipped one (12,000 steps) 0.980 at 3."""
VIDEO_TEACHER_WEIGHTS = BUILTIN_WEIGHTS.parent / "tiny_av_teacher_video"
AUDIO_TEACHER_WEIGHTS = BUILTIN_WEIGHTS.parent / "tiny_av_teacher_audio"
"""The shipped per-modality tiny teachers (teacher.routes): the teacher's recipe, trained on the
picture and visibility parts only, or on the spectrum and loudness parts only."""
BUILTIN_NAMES = {
    "builtin": BUILTIN_WEIGHTS,
    "builtin-teacher": TEACHER_WEIGHTS,
    "builtin-teacher-video": VIDEO_TEACHER_WEIGHTS,
    "builtin-teacher-audio": AUDIO_TEACHER_WEIGHTS,
}
MAKE_COMMANDS = {
    BUILTIN_WEIGHTS: "odrl pretrain",
    TEACHER_WEIGHTS: "odrl pretrain --teacher",
    VIDEO_TEACHER_WEIGHTS: "odrl pretrain --teacher --parts picture,visibility --steps 6000",
    AUDIO_TEACHER_WEIGHTS: "odrl pretrain --teacher --parts spectrum,loudness --steps 6000",
}
"""The command that re-creates each shipped model."""
SHIPPED_PART_TEACHERS = {
    frozenset({"picture", "visibility"}): VIDEO_TEACHER_WEIGHTS,
    frozenset({"spectrum", "loudness"}): AUDIO_TEACHER_WEIGHTS,
}


def model_folder(name: str | Path) -> Path:
    """The folder a tiny_av model name stands for: a shipped model's ('builtin', 'builtin-teacher',
    'builtin-teacher-video', 'builtin-teacher-audio') or the path itself."""
    return BUILTIN_NAMES.get(str(name), Path(name))


class HashedWordTokenizer:
    """Words -> ids by a stable hash: works offline on any text, no vocabulary file. Words past
    `max_tokens` are dropped, with a warning (once per tokenizer) naming the prompt."""

    def __init__(self, vocab_size: int, max_tokens: int) -> None:
        self.vocab_size = vocab_size
        self.max_tokens = max_tokens
        self.warned_truncation = False

    def __call__(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.zeros(len(prompts), self.max_tokens, dtype=torch.long)
        for i, prompt in enumerate(prompts):
            words = re.findall(r"[a-z0-9]+", prompt.lower())
            if len(words) > self.max_tokens and not self.warned_truncation:
                self.warned_truncation = True
                warnings.warn(
                    f"prompt of {len(words)} words cut to the model's {self.max_tokens} "
                    f"(max_text_tokens): {prompt!r}; the model never sees the rest",
                    stacklevel=2,
                )
            for j, word in enumerate(words[: self.max_tokens]):
                ids[i, j] = 1 + zlib.crc32(word.encode()) % (self.vocab_size - 1)
        return ids, ids != 0


def timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Sinusoidal features of t * 1000."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = (t.float() * 1000.0)[:, None] * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim)
        self.to_k = nn.Linear(dim, dim)
        self.to_v = nn.Linear(dim, dim)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

        out = F.scaled_dot_product_attention(
            split(self.to_q(x)),
            split(self.to_k(x)),
            split(self.to_v(x)),
            attn_mask=key_mask[:, None, None, :],
        )
        return self.to_out(out.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ff_in = nn.Linear(dim, dim * mlp_ratio)
        self.ff_out = nn.Linear(dim * mlp_ratio, dim)
        self.modulation = nn.Linear(dim, 6 * dim)
        nn.init.zeros_(self.modulation.weight)
        nn.init.zeros_(self.modulation.bias)

    def forward(self, x: torch.Tensor, c: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        shift1, scale1, gate1, shift2, scale2, gate2 = self.modulation(F.silu(c))[:, None].chunk(6, dim=-1)
        x = x + gate1 * self.attn(self.norm1(x) * (1 + scale1) + shift1, key_mask)
        h = self.norm2(x) * (1 + scale2) + shift2
        return x + gate2 * self.ff_out(F.gelu(self.ff_in(h)))


PART_NAMES = ("picture", "visibility", "spectrum", "loudness")
"""The latent's parts, in order: the video's (picture, visibility) and the audio's (spectrum, loudness)."""
MODALITY_PARTS = {"video": ("picture", "visibility"), "audio": ("spectrum", "loudness")}


class LatentLayout:
    """The tiny model's latent, a compressed description of a clip (as a VAE's latent would be):
    [picture 3 x S x S | visibility per video frame | spectrum over the audio bins | loudness per
    audio frame], all in [-1, 1]. The fixed decoder shows the picture in each frame as much as that
    frame's visibility says, and plays the spectrum as loud as each audio frame's loudness says.
    A world clip (one shape, in some frames, one tone, in some frames) is encoded exactly; so is a
    frame flooded with colour or a tone that lasts the whole clip: the latent does not stop a policy
    from gaming its rewards, the rewards must.
    """

    def __init__(self, video_frames: int, video_size: int, audio_frames: int, audio_bins: int) -> None:
        self.video_frames, self.video_size = video_frames, video_size
        self.audio_frames, self.audio_bins = audio_frames, audio_bins
        self.picture_dim = 3 * video_size * video_size
        self.sizes = [self.picture_dim, video_frames, audio_bins, audio_frames]
        self.dim = sum(self.sizes)

    def describe(self) -> str:
        """What the latent's entries mean (teachers and students must agree on it)."""
        return (
            f"picture 3x{self.video_size}x{self.video_size} | visibility {self.video_frames} | "
            f"spectrum {self.audio_bins} | loudness {self.audio_frames}"
        )

    def parts(self) -> dict[str, tuple[int, int]]:
        """Where each named part lies in the latent, [start, stop): what teacher routes name."""
        bounds, start = {}, 0
        for name, size in zip(PART_NAMES, self.sizes, strict=True):
            bounds[name], start = (start, start + size), start + size
        return bounds

    def split(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[B, dim] -> picture [B, picture_dim], visibility [B, F], spectrum [B, K], loudness [B, T]."""
        return list(x.split(self.sizes, dim=1))

    def decode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Video [B, F, 3, S, S] in [0, 1] and audio amplitudes [B, T, K] in [0, 1]."""
        picture, visible, spectrum, loudness = (((part + 1) / 2).clamp(0, 1) for part in self.split(x))
        s = self.video_size
        picture = picture.view(-1, 1, 3, s, s)
        video = clip.BACKGROUND + visible[:, :, None, None, None] * (picture - clip.BACKGROUND)
        return video, loudness[:, :, None] * spectrum[:, None, :]

    def encode(self, video: torch.Tensor, amps: torch.Tensor) -> torch.Tensor:
        """The latent of clips made of one picture and one sound: video [B, F, 3, S, S], amplitudes
        [B, T, K], both in [0, 1] (world.render_scene's clips are encoded exactly)."""
        shown = (video - clip.BACKGROUND).abs().flatten(2).amax(-1) > 1e-3  # [B, F]
        brightest = (video - clip.BACKGROUND).abs().flatten(2).sum(-1).argmax(1)
        picture = video[torch.arange(len(video)), brightest]
        parts = [picture.flatten(1), shown.to(video.dtype), amps.amax(1), amps.amax(2)]
        return torch.cat(parts, dim=1) * 2 - 1


class TinyAVTransformer(ModelMixin, ConfigMixin):
    """Velocity model for the tiny latent (`LatentLayout`): picture patches, one timing token
    (visibility and loudness) and one pitch token (the spectrum), attended jointly with the words."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        video_frames: int = clip.VIDEO_FRAMES,
        video_size: int = clip.VIDEO_SIZE,
        patch_size: int = 4,
        audio_frames: int = clip.AUDIO_FRAMES,
        audio_bins: int = clip.AUDIO_BINS,
        dim: int = 96,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        vocab_size: int = 1024,
        max_text_tokens: int = 16,
        prediction: str = "sample",
    ) -> None:
        super().__init__()
        if prediction not in ("velocity", "sample"):
            raise ValueError(f"prediction must be 'velocity' or 'sample'; got {prediction!r}")
        self.layout = LatentLayout(video_frames, video_size, audio_frames, audio_bins)
        self.grid = video_size // patch_size
        self.patch_dim = 3 * patch_size * patch_size
        timing_dim = video_frames + audio_frames
        num_latent_tokens = self.grid**2 + 2
        self.picture_in = nn.Linear(self.patch_dim, dim)
        self.timing_in = nn.Linear(timing_dim, dim)
        self.pitch_in = nn.Linear(audio_bins, dim)
        self.word_embedding = nn.Embedding(vocab_size, dim)
        self.latent_pos = nn.Parameter(torch.randn(1, num_latent_tokens, dim) * 0.02)
        self.text_pos = nn.Parameter(torch.randn(1, max_text_tokens, dim) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_pool = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.gradient_checkpointing = False  # enable_gradient_checkpointing() turns it on
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_modulation = nn.Linear(dim, 2 * dim)
        nn.init.zeros_(self.final_modulation.weight)
        nn.init.zeros_(self.final_modulation.bias)
        self.picture_out = nn.Linear(dim, self.patch_dim)
        self.timing_out = nn.Linear(dim, timing_dim)
        self.pitch_out = nn.Linear(dim, audio_bins)

    def _patchify(self, picture: torch.Tensor) -> torch.Tensor:
        b, p, g = picture.shape[0], self.config.patch_size, self.grid
        v = picture.view(b, 3, g, p, g, p).permute(0, 2, 4, 1, 3, 5)
        return v.reshape(b, g * g, self.patch_dim)

    def _unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        b, p, g = tokens.shape[0], self.config.patch_size, self.grid
        v = tokens.view(b, g, g, 3, p, p).permute(0, 3, 1, 4, 2, 5)
        return v.reshape(b, -1)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """The velocity at (x, t); with prediction='sample' the network predicts x0 and the velocity
        is (x - x0) / max(t, 0.05)."""
        c = self.config
        picture, visible, spectrum, loudness = self.layout.split(x)
        latent_tokens = torch.cat(
            [
                self.picture_in(self._patchify(picture)),
                self.timing_in(torch.cat([visible, loudness], dim=1))[:, None],
                self.pitch_in(spectrum)[:, None],
            ],
            dim=1,
        )
        out = joint_attention(self, latent_tokens + self.latent_pos, text_ids, text_mask, t, x.dtype)
        n = self.grid**2
        timing = self.timing_out(out[:, n])
        y = torch.cat(
            [
                self._unpatchify(self.picture_out(out[:, :n])),
                timing[:, : c.video_frames],
                self.pitch_out(out[:, n + 1]),
                timing[:, c.video_frames :],
            ],
            dim=1,
        )
        return velocity_from(x, y, t, c.prediction)


def joint_attention(
    model: nn.Module,
    latent_tokens: torch.Tensor,
    text_ids: torch.Tensor,
    text_mask: torch.Tensor,
    t: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The prompt's word tokens and `latent_tokens` [B, N, dim] through `model`'s blocks, modulated
    by the timestep (its features in `dtype`, the latent's) and the pooled prompt (adaLN-Zero); the
    latent tokens out, after the final modulation [B, N, dim]. `model` has the tiny models'
    embeddings, blocks and final layers."""
    words = model.word_embedding(text_ids) + model.text_pos[:, : text_ids.shape[1]]
    mask_f = text_mask.unsqueeze(-1).to(words.dtype)
    pooled = (words * mask_f).sum(1) / mask_f.sum(1).clamp(min=1)
    cond = model.time_mlp(timestep_embedding(t, model.config.dim).to(latent_tokens.dtype)) + model.text_pool(
        pooled
    )
    tokens = torch.cat([words, latent_tokens], dim=1)
    ones = torch.ones(
        len(latent_tokens), latent_tokens.shape[1], dtype=torch.bool, device=latent_tokens.device
    )
    key_mask = torch.cat([text_mask, ones], dim=1)
    for block in model.blocks:
        if torch.is_grad_enabled() and model.gradient_checkpointing:
            tokens = model._gradient_checkpointing_func(block, tokens, cond, key_mask)
        else:
            tokens = block(tokens, cond, key_mask)
    shift, scale = model.final_modulation(F.silu(cond))[:, None].chunk(2, dim=-1)
    return model.final_norm(tokens[:, words.shape[1] :]) * (1 + scale) + shift


def velocity_from(x: torch.Tensor, y: torch.Tensor, t: torch.Tensor, prediction: str) -> torch.Tensor:
    """The velocity at (x, t) from the network's output y: y itself, or with prediction='sample'
    (y is x0) (x - y) / max(t, 0.05)."""
    if prediction == "sample":
        return (x - y) / t.to(x.dtype).clamp(min=0.05)[:, None]
    return y


class HashedPromptPolicy:
    """What the tiny models' policies share: prompts as hashed words (the transformer's config says
    how many ids and words), and the transformer's velocity."""

    lora_targets = DEFAULT_LORA_TARGETS

    def __init__(self, transformer: nn.Module) -> None:
        self.transformer = transformer
        cfg = transformer.config
        self.tokenizer = HashedWordTokenizer(cfg.vocab_size, cfg.max_text_tokens)

    def encode_prompts(self, prompts: list[str]) -> Condition:
        ids, mask = self.tokenizer(prompts)
        return {"text_ids": ids, "text_mask": mask}

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, cond: Condition) -> torch.Tensor:
        return self.transformer(x_t, t, cond["text_ids"], cond["text_mask"])


class TinyAVPolicy(HashedPromptPolicy):
    """The FlowPolicy of the built-in model: hashed-word prompts in, a MediaBatch out."""

    @classmethod
    def from_pretrained(cls, path: str | Path = "builtin") -> TinyAVPolicy:
        """Load 'builtin' (the shipped base model), 'builtin-teacher' (the shipped tiny teacher),
        'builtin-teacher-video' / 'builtin-teacher-audio' (its per-modality ones) or a directory
        written by save_pretrained."""
        path = model_folder(path)
        if not (path / "config.json").is_file():
            command = MAKE_COMMANDS.get(path)
            hint = f" Run `{command}` to create it." if command else ""
            raise FileNotFoundError(f"no tiny_av model at {path} (config.json missing).{hint}")
        return cls(TinyAVTransformer.from_pretrained(path))

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (self.transformer.layout.dim,)

    def modality_entries(self) -> dict[str, torch.Tensor]:
        """The picture and visibility are the video; the spectrum and loudness the audio."""
        parts = self.transformer.layout.parts()
        spans = {m: [torch.arange(*parts[p]) for p in names] for m, names in MODALITY_PARTS.items()}
        return {m: torch.cat(indices) for m, indices in spans.items()}

    def decode(self, x0: torch.Tensor) -> MediaBatch:
        video, amps = self.transformer.layout.decode(x0.float())
        return MediaBatch(
            video=video, audio=clip.synthesize_audio(amps), fps=clip.FPS, sample_rate=clip.SAMPLE_RATE
        )
