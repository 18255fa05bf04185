"""Programmatic detectors for the tiny world: each reads the decoded media, returns [B] in [0, 1].

Prompts that are not tiny-world prompts are an error (a detector cannot guess a target).
"""

from __future__ import annotations

import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.world import tiny_world as world


def _scenes(prompts: list[str]) -> list[world.Scene]:
    scenes = []
    for p in prompts:
        scene = world.parse_prompt(p)
        if scene is None:
            raise ValueError(
                f"'{p}' is not a tiny-world prompt (expected e.g. '{world.ALL_SCENES[0].prompt}')"
            )
        scenes.append(scene)
    return scenes


def _need(media: MediaBatch, video: bool = False, audio: bool = False) -> None:
    if video and media.video is None:
        raise ValueError("this reward needs video frames; the media batch has none")
    if audio and media.audio is None:
        raise ValueError("this reward needs audio; the media batch has none")


def _foreground(video: torch.Tensor) -> torch.Tensor:
    """Pixels that stand out of the dark background: [B, F, H, W] bool."""
    return video.amax(dim=2) > world.BACKGROUND + 0.25


@rewards.register("color_match")
class ColorMatchReward:
    """How close the mean colour of the foreground is to the prompt's colour (Gaussian, sigma 0.25)."""

    def __init__(self, sigma: float = 0.25, min_pixels: int = 4) -> None:
        self.sigma = sigma
        self.min_pixels = min_pixels

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        _need(media, video=True)
        video = media.video.float()
        fg = _foreground(video).unsqueeze(2)  # [B, F, 1, H, W]
        count = fg.sum(dim=(1, 3, 4)).squeeze(1)
        mean_rgb = (video * fg).sum(dim=(1, 3, 4)) / count.clamp(min=1).unsqueeze(1)
        target = torch.tensor([world.COLORS[s.color] for s in _scenes(prompts)], device=video.device)
        dist2 = ((mean_rgb - target) ** 2).sum(1)
        score = torch.exp(-dist2 / (2 * self.sigma**2))
        return torch.where(count >= self.min_pixels, score, torch.zeros_like(score))


def _spectrum(audio: torch.Tensor, sample_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    mono = audio.float().mean(dim=1)
    window = torch.hann_window(mono.shape[-1], device=mono.device)
    power = torch.fft.rfft(mono * window, dim=-1).abs() ** 2
    freqs = torch.fft.rfftfreq(mono.shape[-1], d=1.0 / sample_rate, device=mono.device)
    return power, freqs


@rewards.register("pitch_match")
class PitchMatchReward:
    """Share of the audio's spectral energy within 1/8 octave of the prompt's pitch."""

    def __init__(self, tolerance_octaves: float = 0.125) -> None:
        self.tolerance = tolerance_octaves

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        _need(media, audio=True)
        power, freqs = _spectrum(media.audio, media.sample_rate)
        target = torch.tensor([world.PITCH_HZ[s.pitch] for s in _scenes(prompts)], device=power.device)
        octaves = torch.log2(freqs.clamp(min=1.0)[None] / target[:, None]).abs()
        band = (octaves <= self.tolerance) & (freqs[None] >= 50)
        audible = freqs[None] >= 50
        total = (power * audible).sum(-1)
        return torch.where(
            total > 1e-6, (power * band).sum(-1) / total.clamp(min=1e-6), torch.zeros_like(total)
        )


def _audio_envelope(audio: torch.Tensor, frames: int) -> torch.Tensor:
    """RMS of the mono waveform in `frames` equal windows: [B, frames]."""
    mono = audio.float().mean(dim=1)
    usable = mono.shape[-1] // frames * frames
    return mono[:, :usable].reshape(len(mono), frames, -1).pow(2).mean(-1).sqrt()


@rewards.register("timing_match")
class TimingMatchReward:
    """Share of the audio energy that falls in the half of the clip the prompt names."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        _need(media, audio=True)
        energy = _audio_envelope(media.audio, 2).pow(2)
        wanted = torch.tensor([0 if s.when == "early" else 1 for s in _scenes(prompts)], device=energy.device)
        total = energy.sum(-1)
        share = energy.gather(1, wanted[:, None]).squeeze(1) / total.clamp(min=1e-8)
        return torch.where(total > 1e-8, share, torch.zeros_like(share))


@rewards.register("av_sync")
class AVSyncReward:
    """Cosine between the visual and the audio activity per video frame (0 if either is flat)."""

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        _need(media, video=True, audio=True)
        _scenes(prompts)
        visual = _foreground(media.video.float()).float().mean(dim=(2, 3))  # [B, F]
        sound = _audio_envelope(media.audio, media.video.shape[1])
        visual = visual - visual.amin(1, keepdim=True)
        sound = sound - sound.amin(1, keepdim=True)
        cos = torch.nn.functional.cosine_similarity(visual, sound, dim=1, eps=1e-8)
        return cos.clamp(0, 1)
