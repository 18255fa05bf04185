"""The tiny clip format, shared by the tiny world (which renders clips in it) and the tiny model (whose
fixed decoder outputs it).

A clip is 4 frames of 16 x 16 pixels on a dark background (BACKGROUND) and half a second of audio.
The audio is described by an amplitude envelope over 16 frequency bins and 8 time frames;
`synthesize_audio` turns it into a waveform (a fixed, differentiable "vocoder"). This module imports
nothing from the package, so the model and the world both build on it without importing each other.
"""

from __future__ import annotations

import math

import torch

VIDEO_FRAMES, VIDEO_SIZE, FPS = 4, 16, 8.0
AUDIO_FRAMES, AUDIO_BINS, SAMPLE_RATE = 8, 16, 8000
DURATION_S = VIDEO_FRAMES / FPS
BACKGROUND = 0.1


def bin_frequency(k: int | torch.Tensor) -> float | torch.Tensor:
    """Centre frequency of audio bin k: quarter-octave steps from 250 Hz."""
    return 250.0 * 2.0 ** (k / 4.0)


def synthesize_audio(amps: torch.Tensor) -> torch.Tensor:
    """Waveform [B, 1, S] from amplitudes [B, AUDIO_FRAMES, AUDIO_BINS] in [0, 1] (differentiable)."""
    return synthesize(amps, SAMPLE_RATE, DURATION_S)


def synthesize(amps: torch.Tensor, sample_rate: int, duration_s: float) -> torch.Tensor:
    """Waveform [B, 1, S] from amplitudes [B, frames, bins] in [0, 1] spread evenly over
    `duration_s` (frame j centred at (j + 1/2) / frames of it), bin k a sine at bin_frequency(k)."""
    frames, bins = amps.shape[1], amps.shape[2]
    n = int(sample_rate * duration_s)
    time = torch.arange(n, dtype=amps.dtype, device=amps.device) / sample_rate
    # Linear interpolation of each bin's envelope between frame centres.
    frame_pos = (time / duration_s * frames - 0.5).clamp(0, frames - 1)
    lo = frame_pos.floor().long()
    hi = (lo + 1).clamp(max=frames - 1)
    w = (frame_pos - lo).view(1, -1, 1)
    env = amps[:, lo] * (1 - w) + amps[:, hi] * w  # [B, S, bins]
    freqs = bin_frequency(torch.arange(bins, dtype=amps.dtype, device=amps.device))
    carriers = torch.sin(2 * math.pi * time.view(-1, 1) * freqs.view(1, -1))  # [S, bins]
    wave = 0.5 * (env * carriers).sum(-1)
    return wave.clamp(-1, 1).unsqueeze(1)
