"""Programmatic rewards for the tiny world: each reads the decoded media, returns [B] in [0, 1].

Each reward's maximum is the prompt's scene and nothing else (tests/test_tiny_world_rewards.py
scores the world's own renders and adversarial ones: a flooded frame, a tone for the whole clip,
noise, a blank clip, the right colour in the wrong shape, ...):
- `color_match`: the colour of the shape's own pixels, only while the picture shows a shape of the
  world's size (a frame painted in the prompt's colour scores near 0);
- `shape_match`: how well the best mask of the prompt's shape fits the foreground, against the best
  mask of the other shape;
- `pitch_match`: the share of spectral energy near the prompt's pitch;
- `timing_match`: sound and shape in the half the prompt names, minus what is in the other half;
- `av_sync`: picture and sound switch on and off together (always-on or always-off scores 0);
- `clean_background`: the pixels away from the shape keep the background colour.

Prompts that are not tiny-world prompts are an error (a detector cannot guess a target).
"""

from __future__ import annotations

import torch

from omni_diffusion_rl.media import MediaBatch
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.reward import InputLimits, samples_by_prompt
from omni_diffusion_rl.world import tiny_world as world

# What the detectors are meant for: the tiny world's clips (room for stereo). Their work grows with
# the square of a frame's pixels (every mask of the world at every place), so a reward server refuses
# larger frames: 64 x 64 frames took 1.2 GB for shape_match, 2048 x 2048 more memory than a machine has.
TINY_CLIP_LIMITS = InputLimits(
    frames=world.VIDEO_FRAMES,
    frame_height=world.VIDEO_SIZE,
    frame_width=world.VIDEO_SIZE,
    audio_samples=2 * round(world.SAMPLE_RATE * world.DURATION_S),
    meant_for=(
        f"the tiny world's clips: {world.VIDEO_FRAMES} frames of {world.VIDEO_SIZE} x {world.VIDEO_SIZE}, "
        f"{world.DURATION_S:g} s of audio at {world.SAMPLE_RATE} Hz"
    ),
)

FOREGROUND_DISTANCE = 0.3  # RGB distance from the background colour that makes a pixel foreground
VISIBLE_PIXELS = 10  # a frame with fewer foreground pixels shows nothing
SMALLEST_SHAPE, LARGEST_SHAPE = 25, 69  # pixel counts of the world's smallest and largest shapes


def _scenes(prompts: list[str]) -> list[world.Scene]:
    scenes = []
    for p in prompts:
        scene = world.parse_prompt(p)
        if scene is None:
            raise ValueError(
                f"'{_shown(p)}' is not a tiny-world prompt (expected e.g. '{world.ALL_SCENES[0].prompt}')"
            )
        scenes.append(scene)
    return scenes


def _shown(prompt: str, most: int = 200) -> str:
    """A prompt as an error message quotes it: at most `most` characters."""
    return prompt if len(prompt) <= most else f"{prompt[:most]}... ({len(prompt)} characters)"


def _video(media: MediaBatch) -> torch.Tensor:
    if media.video is None:
        raise ValueError("this reward needs video frames; the media batch has none")
    return media.video.float()


def _audio(media: MediaBatch) -> torch.Tensor:
    if media.audio is None:
        raise ValueError("this reward needs audio; the media batch has none")
    return media.audio.float().mean(dim=1)  # mono [B, S]


def _foreground(video: torch.Tensor) -> torch.Tensor:
    """[B, F, H, W] bool: pixels whose colour is clearly not the background's."""
    return (video - world.BACKGROUND).pow(2).sum(dim=2).sqrt() > FOREGROUND_DISTANCE


def _size_fit(pixels: torch.Tensor) -> torch.Tensor:
    """1 for a pixel count within the world's shape sizes, falling smoothly outside."""
    small = (pixels / SMALLEST_SHAPE).clamp(max=1)
    large = torch.exp(-(((pixels - LARGEST_SHAPE).clamp(min=0) / 30.0) ** 2))
    return small * large


def _per_visible_frame(values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Mean of [B, F] values over each sample's visible frames; 0 where none is visible."""
    count = visible.sum(1)
    total = (values * visible).sum(1)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def _best_masks(fg: torch.Tensor, kind: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IoU of each frame's foreground with the best world mask of shape `kind` [B] and of the other
    shape: two [B, F] tensors."""
    b, f, h, w = fg.shape
    bank, kinds = world.all_shape_masks(h)
    flat = fg.reshape(b, f, h * w).float()
    bank = bank.float()
    inter = flat @ bank.T  # [B, F, M]
    iou = inter / (flat.sum(-1, keepdim=True) + bank.sum(1) - inter).clamp(min=1)
    wanted = kinds[None, :] == kind[:, None]  # [B, M]
    best_wanted = iou.masked_fill(~wanted[:, None], 0).amax(-1)
    best_other = iou.masked_fill(wanted[:, None], 0).amax(-1)
    return best_wanted, best_other


def _envelope(mono: torch.Tensor, windows: int) -> torch.Tensor:
    """RMS of the waveform in `windows` equal windows: [B, windows]."""
    usable = mono.shape[-1] // windows * windows
    return mono[:, :usable].reshape(len(mono), windows, -1).pow(2).mean(-1).sqrt()


def _named_half(scenes: list[world.Scene], device: torch.device) -> torch.Tensor:
    return torch.tensor([0 if s.when == "early" else 1 for s in scenes], device=device)


@rewards.register("color_match")
class ColorMatchReward:
    """Closeness of the shape's pixels to the prompt's colour (Gaussian per pixel, sigma 0.25), times
    how well each visible frame's foreground fits the world's shape sizes."""

    input_limits = TINY_CLIP_LIMITS
    modality = "video"

    def __init__(self, sigma: float = 0.25) -> None:
        self.sigma = sigma

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        video = _video(media)
        fg = _foreground(video)
        counts = fg.flatten(2).sum(-1).float()  # [B, F]
        visible = counts >= VISIBLE_PIXELS
        target = torch.tensor([world.COLORS[s.color] for s in _scenes(prompts)], device=video.device)
        dist2 = (video - target[:, None, :, None, None]).pow(2).sum(2)  # [B, F, H, W]
        closeness = torch.exp(-dist2 / (2 * self.sigma**2))
        on_shape = (closeness * fg).flatten(2).sum(-1) / counts.clamp(min=1)
        return _per_visible_frame(on_shape * _size_fit(counts), visible)


@rewards.register("shape_match")
class ShapeMatchReward:
    """Per visible frame: IoU of the foreground with the best mask of the prompt's shape, scaled down
    as the best mask of the other shape fits about as well (`margin` of IoU decides)."""

    input_limits = TINY_CLIP_LIMITS
    modality = "video"

    def __init__(self, margin: float = 0.08) -> None:
        self.margin = margin

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        fg = _foreground(_video(media))
        visible = fg.flatten(2).sum(-1) >= VISIBLE_PIXELS
        kind = torch.tensor([world.SHAPES.index(s.shape) for s in _scenes(prompts)], device=fg.device)
        wanted, other = _best_masks(fg, kind)
        contrast = (0.5 + 0.5 * (wanted - other) / self.margin).clamp(0, 1)
        return _per_visible_frame(wanted * contrast, visible)


def _spectrum(mono: torch.Tensor, sample_rate: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.hann_window(mono.shape[-1], device=mono.device)
    power = torch.fft.rfft(mono * window, dim=-1).abs() ** 2
    freqs = torch.fft.rfftfreq(mono.shape[-1], d=1.0 / sample_rate, device=mono.device)
    return power, freqs


@rewards.register("pitch_match")
class PitchMatchReward:
    """Share of the audio's spectral energy within 1/8 octave of the prompt's pitch."""

    input_limits = TINY_CLIP_LIMITS
    modality = "audio"

    def __init__(self, tolerance_octaves: float = 0.125) -> None:
        self.tolerance = tolerance_octaves

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        power, freqs = _spectrum(_audio(media), media.sample_rate)
        target = torch.tensor([world.PITCH_HZ[s.pitch] for s in _scenes(prompts)], device=power.device)
        octaves = torch.log2(freqs.clamp(min=1.0)[None] / target[:, None]).abs()
        audible = freqs[None] >= 50
        band = (octaves <= self.tolerance) & audible
        total = (power * audible).sum(-1)
        return torch.where(
            total > 1e-6, (power * band).sum(-1) / total.clamp(min=1e-6), torch.zeros_like(total)
        )


def _half_contrast(per_half: torch.Tensor, named: torch.Tensor) -> torch.Tensor:
    """(named half - other half) / both, from [B, 2] non-negative amounts; 0 when both are empty."""
    total = per_half.sum(1)
    wanted = per_half.gather(1, named[:, None]).squeeze(1)
    contrast = (2 * wanted - total) / total.clamp(min=1e-8)
    return torch.where(total > 1e-8, contrast.clamp(min=0), torch.zeros_like(total))


@rewards.register("timing_match")
class TimingMatchReward:
    """Sound and picture in the half the prompt names: for each, (energy or foreground in the named
    half - in the other half) / both, and the two multiplied. A tone for the whole clip scores 0."""

    input_limits = TINY_CLIP_LIMITS
    modality = "audio_video"

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        mono, video = _audio(media), _video(media)
        named = _named_half(_scenes(prompts), mono.device)
        sound = _half_contrast(_envelope(mono, 2).pow(2), named)
        counts = _foreground(video).flatten(2).sum(-1).float()  # [B, F]
        half = counts.shape[1] // 2
        picture = _half_contrast(torch.stack([counts[:, :half].sum(1), counts[:, half:].sum(1)], 1), named)
        return sound * picture


@rewards.register("av_sync")
class AVSyncReward:
    """Picture and sound on together and off together, frame by frame: 1 - mean |picture - sound|
    activity, times how much each switches (max - min over the clip), so always-on scores 0. Sound
    activity rises from 0 at `quiet_rms` to 1 at `loud_rms` (the world's tone is 0.35 RMS)."""

    input_limits = TINY_CLIP_LIMITS
    modality = "audio_video"

    def __init__(self, quiet_rms: float = 0.06, loud_rms: float = 0.2) -> None:
        self.quiet_rms, self.loud_rms = quiet_rms, loud_rms

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        video, mono = _video(media), _audio(media)
        _scenes(prompts)
        counts = _foreground(video).flatten(2).sum(-1).float()
        picture = (counts / SMALLEST_SHAPE).clamp(max=1)  # [B, F]
        level = _envelope(mono, video.shape[1])
        sound = ((level - self.quiet_rms) / (self.loud_rms - self.quiet_rms)).clamp(0, 1)
        agreement = 1 - (picture - sound).abs().mean(1)

        def switching(x: torch.Tensor) -> torch.Tensor:
            return x.amax(1) - x.amin(1)

        return agreement * switching(picture) * switching(sound)


@rewards.register("clean_background")
class CleanBackgroundReward:
    """1 - the mean deviation from the background colour (in units of `tolerance`, capped at 1) of the
    pixels away from the shape: outside the best-fitting world mask, grown by one pixel."""

    input_limits = TINY_CLIP_LIMITS
    modality = "video"

    def __init__(self, tolerance: float = 0.1) -> None:
        self.tolerance = tolerance

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        video = _video(media)
        _scenes(prompts)
        fg = _foreground(video)
        b, f, h, w = fg.shape
        bank, _ = world.all_shape_masks(h)
        flat = fg.reshape(b * f, h * w).float()
        inter = flat @ bank.float().T
        iou = inter / (flat.sum(1, keepdim=True) + bank.sum(1) - inter).clamp(min=1)
        shape = bank[iou.argmax(1)].view(b * f, 1, h, w).float()
        visible = (flat.sum(1) >= VISIBLE_PIXELS).view(b * f, 1, 1, 1)
        near_shape = (torch.nn.functional.max_pool2d(shape, 3, 1, 1) > 0) & visible
        deviation = (video - world.BACKGROUND).abs().amax(dim=2).view(b * f, 1, h, w)
        away = (~near_shape).float()
        error = ((deviation / self.tolerance).clamp(max=1) * away).sum((1, 2, 3)) / away.sum((1, 2, 3))
        return 1 - error.view(b, f).mean(1)


@rewards.register("group_diversity")
class GroupDiversityReward:
    """Where a sample puts its shape, against the other samples of its prompt in the batch: the mean
    distance of its foreground centre to theirs, in units of `spread` pixels, capped at 1.

    Prompts never say where the shape is, and the world draws it anywhere (two of its clips are
    3.1 pixels apart on average); without this term, reward fine-tuning piles every sample of a
    prompt onto one spot (measured: diversity within a prompt 0.19 -> 0.05). A sample whose prompt
    has no other sample in the batch cannot be scored: NaN (a failed sample, never a 0). Score a
    prompt's samples in one call (a reward server's --max-batch a multiple of the group size).
    """

    input_limits = TINY_CLIP_LIMITS
    modality = "video"

    def __init__(self, spread: float = 2.5) -> None:
        self.spread = spread

    def score(self, media: MediaBatch, prompts: list[str]) -> torch.Tensor:
        fg = _foreground(_video(media)).any(dim=1).float()  # [B, H, W]: where anything was shown
        _scenes(prompts)
        h, w = fg.shape[1:]
        mass = fg.sum((1, 2)).clamp(min=1)
        ys = (fg * torch.arange(h, device=fg.device)[:, None]).sum((1, 2)) / mass
        xs = (fg * torch.arange(w, device=fg.device)[None, :]).sum((1, 2)) / mass
        centres = torch.stack([ys, xs], dim=1)
        out = torch.full((len(prompts),), float("nan"), device=fg.device)
        for members in samples_by_prompt(prompts):
            if len(members) < 2:
                continue  # nothing to compare with: NaN, so the sample counts as not scored
            c = centres[members]
            mean_distance = torch.cdist(c, c).sum(1) / (len(members) - 1)
            out[members] = (mean_distance / self.spread).clamp(max=1)
        return torch.where((fg.sum((1, 2)) > 0) | out.isnan(), out, torch.zeros_like(out))
