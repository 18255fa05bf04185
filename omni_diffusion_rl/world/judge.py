"""Classify tiny-world clips attribute by attribute: the evaluation that training never sees.

Written apart from the training rewards (rewards/tiny_world.py) and on other principles: the
rewards are smooth scores, the judge makes hard decisions. A shape counts when a mask of the
world's own shapes and sizes matches the frame's foreground (IoU); a colour when the recognised shape's
median pixel is nearest to the prompt's palette colour; a pitch when one of the three pitch bands holds
most of the sound; timing when both the shape and the tone are in the half the prompt names and
nowhere else. Health signs (flooded frames, stray pixels, shapes in both halves, silence, diversity
within a prompt's samples) catch a model that games its rewards. Two picture measures grade what
the yes/no signs let through: grain and ghosts on the background (`background_noise`) and mottling
inside the shape (`shape_texture`), both 0 on the world's own clips.

Every function is a pure tensor function of decoded media; `judge_clips` is the entry point.
"""

from __future__ import annotations

import math

import torch

from . import tiny_world as world

FOREGROUND_DISTANCE = 0.3  # RGB distance from the background colour that makes a pixel foreground
MIN_SHAPE_PIXELS = 10  # a frame with fewer foreground pixels shows no shape
FLOODED_SHARE = 0.35  # a frame with more foreground than this is flooded
SHAPE_IOU = 0.8  # the best world mask must overlap the foreground this well
COLOR_DISTANCE = 0.2  # the shape's median colour must be this close to the palette colour
STRAY_PIXEL_DEVIATION = 0.1  # a background pixel this far from the background colour is stray
CLEAN_STRAY_SHARE = 0.02  # a clean background has at most this share of stray pixels
SILENCE_RMS = 0.02  # audio quieter than this is silent
NAMED_HALF_SHARE = 0.85  # the named half must hold this share of the audio energy
PITCH_BAND_OCTAVES = 0.125  # a pitch band spans this many octaves either side of the pitch
PITCH_SHARE = 0.6  # the winning pitch band must hold this share of the audible energy

ATTRIBUTES = ("color", "shape", "pitch", "timing")
HEALTH = (
    "recognisable_shape",
    "flooded",
    "clean_background",
    "shape_in_both_halves",
    "sound_only_in_named_half",
    "silent",
)


PICTURE_MEASURES = ("background_noise", "shape_texture")
"""Continuous measures of the picture, lower is cleaner, 0 on the world's own clips (the mean over
samples: a sample whose matched shape covers fewer than MIN_SHAPE_PIXELS foreground pixels has no
shape texture)."""


def foreground(video: torch.Tensor) -> torch.Tensor:
    """[B, F, 3, H, W] -> [B, F, H, W] bool: pixels clearly unlike the background colour."""
    return (video.float() - world.BACKGROUND).pow(2).sum(dim=2).sqrt() > FOREGROUND_DISTANCE


def best_world_masks(fg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """For each frame [B, F, H, W]: the IoU of the best-matching world mask, its shape index and the
    mask itself ([B, F], [B, F], [B, F, H, W])."""
    b, f, h, w = fg.shape
    bank, kinds = world.all_shape_masks(h)
    flat = fg.reshape(b * f, h * w).float()
    bank_f = bank.float()
    inter = flat @ bank_f.T
    union = flat.sum(1, keepdim=True) + bank_f.sum(1)[None] - inter
    iou = inter / union.clamp(min=1)
    best_iou, best = iou.max(dim=1)
    return best_iou.view(b, f), kinds[best].view(b, f), bank[best].view(b, f, h, w)


def _halves(frames: int) -> torch.Tensor:
    """[2, frames] bool: which frames form the first and the second half."""
    first = torch.arange(frames) < frames // 2
    return torch.stack([first, ~first])


def judge_video(video: torch.Tensor, scenes: list[world.Scene]) -> dict[str, torch.Tensor]:
    """Per-sample decisions [B] (bool) on the picture, and its measures (float, PICTURE_MEASURES)."""
    b, f = video.shape[:2]
    fg = foreground(video)
    counts = fg.flatten(2).sum(-1)  # [B, F]
    visible = counts >= MIN_SHAPE_PIXELS
    halves = _halves(f).to(video.device)
    named = torch.stack([halves[0 if s.when == "early" else 1] for s in scenes])  # [B, F]
    iou, kind, mask = best_world_masks(fg)
    good_frame = visible & (iou >= SHAPE_IOU)
    any_visible = visible.any(1)
    recognisable = any_visible & (good_frame | ~visible).all(1)
    # One shape in every visible frame: the kind of the frames' best masks must agree.
    first_kind = torch.where(visible, kind, torch.full_like(kind, -1)).amax(1)
    same_kind = ((kind == first_kind[:, None]) | ~visible).all(1)
    wanted_kind = torch.tensor([world.SHAPES.index(s.shape) for s in scenes], device=video.device)
    shape_ok = recognisable & same_kind & (first_kind == wanted_kind)

    # Colour: the median pixel of the matched shape's foreground, nearest palette colour.
    palette = torch.tensor(list(world.COLORS.values()), device=video.device)  # [C, 3]
    on_shape = (fg & mask & visible[..., None, None]).unsqueeze(2).expand(-1, -1, 3, -1, -1)
    color_ok = torch.zeros(b, dtype=torch.bool, device=video.device)
    texture = torch.full((b,), math.nan, device=video.device)
    names = list(world.COLORS)
    for i, scene in enumerate(scenes):
        pixels = video[i].float().permute(1, 0, 2, 3)[on_shape[i].permute(1, 0, 2, 3)].view(3, -1)
        if pixels.shape[1] < MIN_SHAPE_PIXELS:
            continue
        median = pixels.median(dim=1).values
        texture[i] = (pixels - median[:, None]).abs().amax(0).mean()  # each pixel's largest channel gap
        distance = (palette - median).pow(2).sum(1).sqrt()
        nearest = int(distance.argmin())
        color_ok[i] = names[nearest] == scene.color and bool(distance[nearest] <= COLOR_DISTANCE)

    # Background: pixels away from the matched shape (grown by one pixel) that deviate from it.
    grown = torch.nn.functional.max_pool2d(mask.float().flatten(0, 1)[:, None], 3, 1, 1)
    grown = grown.view(b, f, *mask.shape[2:])
    shape_area = (grown > 0) & visible[..., None, None]
    deviation = (video.float() - world.BACKGROUND).abs().amax(dim=2)  # [B, F, H, W]
    stray = ((deviation > STRAY_PIXEL_DEVIATION) & ~shape_area).flatten(1).float().mean(1)
    background = (~shape_area).flatten(1).float()  # a frame that shows no shape is all background
    noise = (deviation.flatten(1) * background).sum(1) / background.sum(1).clamp(min=1)

    return {
        "shape": shape_ok,
        "color": color_ok & recognisable,  # the colour of a shape: no shape, no colour
        "shape_in_named_half": any_visible & (visible == named).all(1),
        "shape_in_both_halves": (visible & halves[0]).any(1) & (visible & halves[1]).any(1),
        "recognisable_shape": recognisable,
        "flooded": (counts.float() / (fg.shape[2] * fg.shape[3]) > FLOODED_SHARE).any(1),
        "clean_background": stray <= CLEAN_STRAY_SHARE,
        "background_noise": noise,
        "shape_texture": texture,
    }


def judge_audio(audio: torch.Tensor, sample_rate: int, scenes: list[world.Scene]) -> dict[str, torch.Tensor]:
    """Per-sample decisions [B] (bool) on the sound."""
    mono = audio.float().mean(dim=1)
    halves = mono[:, : mono.shape[-1] // 2 * 2].reshape(len(mono), 2, -1)
    energy = halves.pow(2).sum(-1)  # [B, 2]
    total = energy.sum(-1)
    rms = (total / halves[0].numel()).sqrt()
    silent = rms < SILENCE_RMS
    named = torch.tensor([0 if s.when == "early" else 1 for s in scenes], device=mono.device)
    share = energy.gather(1, named[:, None]).squeeze(1) / total.clamp(min=1e-12)
    in_named_half = ~silent & (share >= NAMED_HALF_SHARE)

    power = torch.fft.rfft(mono * torch.hann_window(mono.shape[-1], device=mono.device), dim=-1).abs() ** 2
    freqs = torch.fft.rfftfreq(mono.shape[-1], d=1.0 / sample_rate, device=mono.device)
    audible = (freqs >= 50).float()
    pitch_names = list(world.PITCH_HZ)
    centres = torch.tensor([world.PITCH_HZ[p] for p in pitch_names], device=mono.device)
    distance = torch.log2(freqs.clamp(min=1.0)[None] / centres[:, None]).abs()  # [P, freqs]
    bands = (distance <= PITCH_BAND_OCTAVES).float() * audible
    band_share = (power @ bands.T) / (power @ audible).clamp(min=1e-12)[:, None]  # [B, P]
    top_share, top = band_share.max(dim=1)
    wanted = torch.tensor([pitch_names.index(s.pitch) for s in scenes], device=mono.device)
    pitch_ok = ~silent & (top == wanted) & (top_share >= PITCH_SHARE)
    return {"pitch": pitch_ok, "sound_only_in_named_half": in_named_half, "silent": silent}


def group_diversity(video: torch.Tensor, prompts: list[str]) -> torch.Tensor:
    """[B]: each sample's mean RMS pixel distance to the other samples of its prompt (NaN alone)."""
    flat = video.float().flatten(1)
    out = torch.full((len(prompts),), float("nan"))
    groups: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p, []).append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        x = flat[members]
        dist = torch.cdist(x, x) / math.sqrt(x.shape[1])
        out[members] = (dist.sum(1) / (len(members) - 1)).cpu()
    return out


def judge_clips(
    video: torch.Tensor, audio: torch.Tensor, sample_rate: int, prompts: list[str]
) -> dict[str, torch.Tensor]:
    """Every decision per sample as float [B] (1 yes, 0 no), plus `all_correct` and `diversity`."""
    scenes = []
    for p in prompts:
        scene = world.parse_prompt(p)
        if scene is None:
            raise ValueError(f"'{p}' is not a tiny-world prompt (e.g. '{world.ALL_SCENES[0].prompt}')")
        scenes.append(scene)
    seen = judge_video(video, scenes)
    heard = judge_audio(audio, sample_rate, scenes)
    decisions = {**seen, **heard}
    decisions["timing"] = seen["shape_in_named_half"] & heard["sound_only_in_named_half"]
    decisions["all_correct"] = torch.stack([decisions[a] for a in ATTRIBUTES]).all(0)
    out = {k: v.float().cpu() for k, v in decisions.items()}
    out["diversity"] = group_diversity(video, prompts)
    return out
