"""The sync clip format, shared by the tiny sync world (which renders its clips through it) and the
tiny sync model (whose fixed decoder it is). It imports nothing from the package but `tiny_clip`'s
vocoder, so the model and the world both build on it without importing each other.

A clip is FRAMES frames of SIZE x SIZE pixels at FPS and a waveform at SAMPLE_RATE. Its latent holds
SLOTS objects; each slot is

- **how it looks**: colour (3 values, the RGB), size (the square's side: 0 draws nothing) and column;
- **how it moves**: its height above the floor on each of the FRAMES frames (per-frame state);
- **how it sounds**: a spectrum over AUDIO_BINS bins and a loudness on each of AUDIO_FRAMES envelope
  frames (HOPS_PER_FRAME a video frame, so a one-frame offset is representable).

Every value is scaled to about [-1, 1] for the flow model. The decoder draws each slot's square at its
fractional position (covered pixels in part: motion below a pixel shows) and sums the slots' sounds
(loudness x spectrum) into one envelope, which `tiny_clip.synthesize` turns into a waveform. The
decoder is differentiable.
"""

from __future__ import annotations

import torch

from .tiny_clip import synthesize

FRAMES, SIZE, FPS = 16, 16, 16.0
HOPS_PER_FRAME = 4
AUDIO_FRAMES, AUDIO_BINS, SAMPLE_RATE = FRAMES * HOPS_PER_FRAME, 16, 8000
DURATION_S = FRAMES / FPS
BACKGROUND = 0.1
SLOTS = 2
MAX_SIDE, MAX_HEIGHT, COLUMN_CENTRE, COLUMN_RANGE = 5.0, 8.0, 5.5, 4.5

PARTS = {  # (first index, length) of each part within a slot
    "color": (0, 3),
    "side": (3, 1),
    "column": (4, 1),
    "height": (5, FRAMES),
    "spectrum": (5 + FRAMES, AUDIO_BINS),
    "loudness": (5 + FRAMES + AUDIO_BINS, AUDIO_FRAMES),
}
SLOT_DIM = 5 + FRAMES + AUDIO_BINS + AUDIO_FRAMES
MODALITY_PARTS = {"video": ("color", "side", "column", "height"), "audio": ("spectrum", "loudness")}
LATENT_DIM = SLOTS * SLOT_DIM


def unit(x: torch.Tensor) -> torch.Tensor:
    """[-1, 1] latent values -> [0, 1] quantities (clamped)."""
    return ((x + 1) / 2).clamp(0, 1)


def from_unit(x: torch.Tensor) -> torch.Tensor:
    """[0, 1] quantities -> [-1, 1] latent values."""
    return 2 * x - 1


def slot_parts(latent: torch.Tensor) -> dict[str, torch.Tensor]:
    """A batch of latents [B, LATENT_DIM] as its parts, each [B, SLOTS, length] (latent scale)."""
    if latent.ndim != 2 or latent.shape[1] != LATENT_DIM:
        raise ValueError(f"sync latents are [B, {LATENT_DIM}]; got {tuple(latent.shape)}")
    slots = latent.view(len(latent), SLOTS, SLOT_DIM)
    return {name: slots[..., start : start + length] for name, (start, length) in PARTS.items()}


def decoded_quantities(latent: torch.Tensor) -> dict[str, torch.Tensor]:
    """The physical quantities a latent decodes to, per slot: colour [B, S, 3] in [0, 1], side and
    column [B, S] in pixels, height [B, S, FRAMES] in pixels (>= 0), spectrum [B, S, BINS] and
    loudness [B, S, AUDIO_FRAMES] in [0, 1]."""
    p = slot_parts(latent)
    return {
        "color": unit(p["color"]),
        "side": MAX_SIDE * unit(p["side"][..., 0]),
        "column": COLUMN_CENTRE + COLUMN_RANGE * p["column"][..., 0].clamp(-1, 1),
        "height": MAX_HEIGHT * unit(p["height"]),
        "spectrum": unit(p["spectrum"]),
        "loudness": unit(p["loudness"]),
    }


def _coverage(start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """How much of each pixel [i, i + 1) of a SIZE-pixel line lies in [start, end): [..., SIZE]."""
    pixels = torch.arange(SIZE, dtype=start.dtype, device=start.device)
    overlap = torch.minimum(pixels + 1, end[..., None]) - torch.maximum(pixels, start[..., None])
    return overlap.clamp(0, 1)


def decode_video(latent: torch.Tensor) -> torch.Tensor:
    """Frames [B, FRAMES, 3, SIZE, SIZE] in [0, 1]: each slot's square drawn over the background,
    slot after slot, its bottom edge `height` pixels above the floor (the bottom of the frame)."""
    q = decoded_quantities(latent)
    batch = len(latent)
    frames = torch.full((batch, FRAMES, 3, SIZE, SIZE), BACKGROUND, dtype=latent.dtype, device=latent.device)
    for s in range(SLOTS):
        side, column = q["side"][:, s], q["column"][:, s]
        across = _coverage(column, column + side)  # [B, SIZE]
        bottom = SIZE - q["height"][:, s]  # [B, FRAMES]
        down = _coverage(bottom - side[:, None], bottom)  # [B, FRAMES, SIZE]
        alpha = (down[..., :, None] * across[:, None, None, :])[:, :, None]  # [B, FRAMES, 1, SIZE, SIZE]
        color = q["color"][:, s][:, None, :, None, None]
        frames = frames * (1 - alpha) + color * alpha
    return frames


def decode_amps(latent: torch.Tensor) -> torch.Tensor:
    """The envelope [B, AUDIO_FRAMES, AUDIO_BINS] in [0, 1]: the slots' loudness x spectrum, summed."""
    q = decoded_quantities(latent)
    return torch.einsum("bsj,bsk->bjk", q["loudness"], q["spectrum"]).clamp(0, 1)


def synthesize_sync(amps: torch.Tensor) -> torch.Tensor:
    """Waveforms [B, 1, SAMPLE_RATE * DURATION_S] from envelopes [B, AUDIO_FRAMES, AUDIO_BINS]."""
    return synthesize(amps, SAMPLE_RATE, DURATION_S)
