"""Tiny AVQA as a user's question file: tiny-world clips written as real MP4 and WAV files, and a
JSONL file of questions about them (answer_data/question_file.py), made by `odrl avqa-files`. The
shipped example set (recipes/data/tiny_avqa_files/) is what the GSPO recipe on files trains on, and
its files are decoded back through the same path as a user's (tested within the codecs' tolerance).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..answer_data.clip_files import ClipFormat, write_mp4, write_wav
from .avqa import QUESTION_KINDS, Question, split_scenes
from .tiny_clip import DURATION_S, FPS, SAMPLE_RATE, VIDEO_FRAMES, VIDEO_SIZE, synthesize, synthesize_audio
from .tiny_world import Scene, render_scene

QUESTION_FILE = "questions.jsonl"
TINY_FORMAT = ClipFormat(FPS, SAMPLE_RATE, DURATION_S, 1, (VIDEO_SIZE, VIDEO_SIZE))
"""The tiny world's own clips (the shipped example set): 8 fps, 8 kHz, half a second, 16 x 16."""


@dataclass(frozen=True)
class ExampleClip:
    name: str  # file stem under clips/
    split: str  # train | heldout
    scene: Scene
    video: torch.Tensor  # [F, 3, H, W]
    wave: torch.Tensor  # [1, S]


def example_clips(
    train_clips: int, heldout_clips: int, seed: int = 0, clip: ClipFormat = TINY_FORMAT
) -> list[ExampleClip]:
    """Clips of scenes spread evenly over each split (held-out scenes are the world's held-out ones),
    each rendered from its own generator keyed by (seed, position), at `clip`'s format (the tiny
    world's own by default; another is the same scene stretched in time and space: `at_format`)."""
    out = []
    for split, count in (("train", train_clips), ("heldout", heldout_clips)):
        scenes = split_scenes(heldout=split == "heldout")
        if not 0 <= count <= len(scenes):
            raise ValueError(f"{count} {split} clips: the {split} split has {len(scenes)} scenes")
        for i in range(count):
            scene = scenes[i * len(scenes) // count]
            gen = torch.Generator().manual_seed(seed * 100_003 + len(out))
            video, amps = render_scene(scene, gen)
            if clip == TINY_FORMAT:
                wave = synthesize_audio(amps.unsqueeze(0))[0]
            else:
                video, wave = at_format(video, amps, clip)
            out.append(ExampleClip(f"{split}_{i:03d}", split, scene, video, wave))
    return out


def at_format(video: torch.Tensor, amps: torch.Tensor, clip: ClipFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """A tiny-world scene at another clip format: each frame the scene's frame at that time (the
    picture held), enlarged or shrunk to the frame size (nearest neighbour: crisp edges; a non-square
    size stretches the shape), and the sound synthesised at the rate and length asked, the tone in
    the same half of the clip."""
    times = torch.arange(clip.frames) / clip.frames  # each frame's start, as a share of the clip
    source = (times * VIDEO_FRAMES).floor().long().clamp(max=VIDEO_FRAMES - 1)
    frames = video[source]
    if clip.frame_size is not None and tuple(frames.shape[-2:]) != clip.frame_size:
        frames = torch.nn.functional.interpolate(frames, clip.frame_size, mode="nearest")
    wave = synthesize(amps.unsqueeze(0), clip.sample_rate, clip.seconds)[0]
    return frames, wave[:, : clip.samples]


def question_lines(clip: ExampleClip, sound_in_video: bool = False) -> list[dict[str, object]]:
    """Every tiny AVQA question about a clip, as question-file lines (multiple choice with its
    options as choices; the description graded by exact match)."""
    lines = []
    for kind in QUESTION_KINDS:
        q = Question(clip.scene, kind)
        line: dict[str, object] = {
            "video": f"clips/{clip.name}.mp4",
            **({} if sound_in_video else {"audio": f"clips/{clip.name}.wav"}),
            "question": q.question,  # its options are rendered from choices (data.choice_format)
            "answer": q.answer,
        }
        if q.choices:
            line["choices"] = list(q.choices)
        lines.append(line | {"category": kind, "split": clip.split})
    return lines


def write_example_set(
    folder: str | Path,
    train_clips: int = 12,
    heldout_clips: int = 4,
    seed: int = 0,
    clip_format: ClipFormat = TINY_FORMAT,
    sound_in_video: bool = False,
) -> Path:
    """The example set in `folder`: clips/*.mp4 (lossless H.264) and clips/*.wav (16-bit PCM), or with
    `sound_in_video` the sound as the MP4's own AAC track (its lines then name the video alone), at
    `clip_format`; and the question file (returned)."""
    from ..media import save_mp4

    folder = Path(folder)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    lines = []
    for clip in example_clips(train_clips, heldout_clips, seed, clip_format):
        mp4 = folder / "clips" / f"{clip.name}.mp4"
        if sound_in_video:
            save_mp4(mp4, clip.video, clip_format.fps, clip.wave, clip_format.sample_rate, scale=1)
        else:
            write_mp4(mp4, clip.video, clip_format.fps)
            write_wav(folder / "clips" / f"{clip.name}.wav", clip.wave, clip_format.sample_rate)
        lines += question_lines(clip, sound_in_video)
    path = folder / QUESTION_FILE
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return path
