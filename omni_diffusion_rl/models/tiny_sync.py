"""The built-in tiny sync model: a text-to-audio-video flow transformer over the sync clip format
(world/sync_clip.py), for the tiny sync world.

Each slot of the latent becomes tokens: one for how it looks and sounds (colour, size, column,
spectrum) and one per video frame for what happens then (its height on that frame and the loudness
of that frame's HOPS_PER_FRAME envelope frames), so that a strike and its sound meet in one token.
The tokens attend jointly with the prompt's words and are modulated by the timestep and the pooled
prompt (adaLN-Zero, as the tiny_av model's blocks, which it reuses).
"""

from __future__ import annotations

from pathlib import Path

import torch
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ..media import MediaBatch
from ..world import sync_clip as clip
from .tiny_av import Block, HashedPromptPolicy, joint_attention, velocity_from

SYNC_BASE_WEIGHTS = Path(__file__).resolve().parent.parent / "assets" / "tiny_sync_base"
LOOKS = ("color", "side", "column", "spectrum")  # a slot's first token
EVENT_WIDTH = 1 + clip.HOPS_PER_FRAME  # a frame token: its height and its envelope frames' loudness


def _look_width() -> int:
    return sum(clip.PARTS[name][1] for name in LOOKS)


class SlotTokens:
    """A sync latent [B, LATENT_DIM] <-> tokens: per slot one look token [LOOK_WIDTH] and FRAMES
    frame tokens [EVENT_WIDTH]."""

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        parts = clip.slot_parts(x)
        looks = torch.cat([parts[name] for name in LOOKS], dim=-1)  # [B, S, look]
        loudness = parts["loudness"].unflatten(-1, (clip.FRAMES, clip.HOPS_PER_FRAME))
        events = torch.cat([parts["height"][..., None], loudness], dim=-1)  # [B, S, FRAMES, EVENT_WIDTH]
        return looks, events

    def join(self, looks: torch.Tensor, events: torch.Tensor) -> torch.Tensor:
        batch = len(looks)
        slots = torch.empty(batch, clip.SLOTS, clip.SLOT_DIM, dtype=looks.dtype, device=looks.device)
        at = 0
        for name in LOOKS:
            start, length = clip.PARTS[name]
            slots[..., start : start + length] = looks[..., at : at + length]
            at += length
        start, length = clip.PARTS["height"]
        slots[..., start : start + length] = events[..., 0]
        start, length = clip.PARTS["loudness"]
        slots[..., start : start + length] = events[..., 1:].flatten(-2)
        return slots.flatten(1)


class TinySyncTransformer(ModelMixin, ConfigMixin):
    """Velocity model for the sync latent: slot tokens and word tokens attended jointly."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(
        self,
        dim: int = 96,
        depth: int = 4,
        heads: int = 4,
        mlp_ratio: int = 4,
        vocab_size: int = 1024,
        max_text_tokens: int = 24,
        prediction: str = "sample",
    ) -> None:
        super().__init__()
        if prediction not in ("velocity", "sample"):
            raise ValueError(f"prediction must be 'velocity' or 'sample'; got {prediction!r}")
        self.tokens = SlotTokens()
        self.look_in = nn.Linear(_look_width(), dim)
        self.event_in = nn.Linear(EVENT_WIDTH, dim)
        self.word_embedding = nn.Embedding(vocab_size, dim)
        self.slot_pos = nn.Parameter(torch.randn(1, clip.SLOTS, 1, dim) * 0.02)
        self.frame_pos = nn.Parameter(torch.randn(1, 1, clip.FRAMES + 1, dim) * 0.02)
        self.text_pos = nn.Parameter(torch.randn(1, max_text_tokens, dim) * 0.02)
        self.time_mlp = nn.Sequential(nn.Linear(dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.text_pool = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, heads, mlp_ratio) for _ in range(depth)])
        self.gradient_checkpointing = False
        self.final_norm = nn.LayerNorm(dim, elementwise_affine=False)
        self.final_modulation = nn.Linear(dim, 2 * dim)
        nn.init.zeros_(self.final_modulation.weight)
        nn.init.zeros_(self.final_modulation.bias)
        self.look_out = nn.Linear(dim, _look_width())
        self.event_out = nn.Linear(dim, EVENT_WIDTH)

    def forward(
        self, x: torch.Tensor, t: torch.Tensor, text_ids: torch.Tensor, text_mask: torch.Tensor
    ) -> torch.Tensor:
        """The velocity at (x, t); with prediction='sample' the network predicts x0 and the velocity
        is (x - x0) / max(t, 0.05)."""
        looks, events = self.tokens.split(x)
        slot_tokens = torch.cat([self.look_in(looks)[:, :, None], self.event_in(events)], dim=2)
        slot_tokens = slot_tokens + self.slot_pos + self.frame_pos  # [B, S, 1 + FRAMES, dim]
        batch, slots, per_slot, dim = slot_tokens.shape
        out = joint_attention(self, slot_tokens.flatten(1, 2), text_ids, text_mask, t, x.dtype)
        out = out.view(batch, slots, per_slot, dim)
        y = self.tokens.join(self.look_out(out[:, :, 0]), self.event_out(out[:, :, 1:]))
        return velocity_from(x, y, t, self.config.prediction)


class TinySyncPolicy(HashedPromptPolicy):
    """The FlowPolicy of the tiny sync model: hashed-word prompts in, a MediaBatch with sound out."""

    @classmethod
    def from_pretrained(cls, path: str | Path = "builtin") -> TinySyncPolicy:
        """Load 'builtin' (the shipped base, `odrl pretrain --sync`) or a directory
        written by save_pretrained."""
        folder = SYNC_BASE_WEIGHTS if str(path) == "builtin" else Path(path)
        if not (folder / "config.json").is_file():
            hint = " Run `odrl pretrain --sync` to create it." if folder == SYNC_BASE_WEIGHTS else ""
            raise FileNotFoundError(f"no tiny_sync model at {folder} (config.json missing).{hint}")
        return cls(TinySyncTransformer.from_pretrained(folder))

    @property
    def latent_shape(self) -> tuple[int, ...]:
        return (clip.LATENT_DIM,)

    def modality_entries(self) -> dict[str, torch.Tensor]:
        """In every slot, the colour, side, column and heights are the video; the spectrum and
        loudness the audio."""
        out = {}
        for modality, names in clip.MODALITY_PARTS.items():
            spans = [
                torch.arange(slot * clip.SLOT_DIM + start, slot * clip.SLOT_DIM + start + length)
                for slot in range(clip.SLOTS)
                for start, length in (clip.PARTS[name] for name in names)
            ]
            out[modality] = torch.cat(spans)
        return out

    def decode(self, x0: torch.Tensor) -> MediaBatch:
        latent = x0.float()
        return MediaBatch(
            video=clip.decode_video(latent),
            audio=clip.synthesize_sync(clip.decode_amps(latent)),
            fps=clip.FPS,
            sample_rate=clip.SAMPLE_RATE,
        )
