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

from ..answer_data.clip_files import write_mp4, write_wav
from .avqa import QUESTION_KINDS, Question, split_scenes
from .tiny_clip import FPS, SAMPLE_RATE, synthesize_audio
from .tiny_world import Scene, render_scene

QUESTION_FILE = "questions.jsonl"


@dataclass(frozen=True)
class ExampleClip:
    name: str  # file stem under clips/
    split: str  # train | heldout
    scene: Scene
    video: torch.Tensor  # [F, 3, H, W]
    wave: torch.Tensor  # [1, S]


def example_clips(train_clips: int, heldout_clips: int, seed: int = 0) -> list[ExampleClip]:
    """Clips of scenes spread evenly over each split (held-out scenes are the world's held-out ones),
    each rendered from its own generator keyed by (seed, position)."""
    out = []
    for split, count in (("train", train_clips), ("heldout", heldout_clips)):
        scenes = split_scenes(heldout=split == "heldout")
        if not 0 <= count <= len(scenes):
            raise ValueError(f"{count} {split} clips: the {split} split has {len(scenes)} scenes")
        for i in range(count):
            scene = scenes[i * len(scenes) // count]
            gen = torch.Generator().manual_seed(seed * 100_003 + len(out))
            video, amps = render_scene(scene, gen)
            wave = synthesize_audio(amps.unsqueeze(0))[0]
            out.append(ExampleClip(f"{split}_{i:03d}", split, scene, video, wave))
    return out


def question_lines(clip: ExampleClip) -> list[dict[str, object]]:
    """Every tiny AVQA question about a clip, as question-file lines (multiple choice with its
    options as choices; the description graded by exact match)."""
    lines = []
    for kind in QUESTION_KINDS:
        q = Question(clip.scene, kind)
        line: dict[str, object] = {
            "video": f"clips/{clip.name}.mp4",
            "audio": f"clips/{clip.name}.wav",
            "question": q.question,  # its options are rendered from choices (data.choice_format)
            "answer": q.answer,
        }
        if q.choices:
            line["choices"] = list(q.choices)
        lines.append(line | {"category": kind, "split": clip.split})
    return lines


def write_example_set(
    folder: str | Path, train_clips: int = 12, heldout_clips: int = 4, seed: int = 0
) -> Path:
    """The example set in `folder`: clips/*.mp4 and clips/*.wav, and the question file (returned)."""
    folder = Path(folder)
    (folder / "clips").mkdir(parents=True, exist_ok=True)
    lines = []
    for clip in example_clips(train_clips, heldout_clips, seed):
        write_mp4(folder / "clips" / f"{clip.name}.mp4", clip.video, FPS)
        write_wav(folder / "clips" / f"{clip.name}.wav", clip.wave, SAMPLE_RATE)
        lines += question_lines(clip)
    path = folder / QUESTION_FILE
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(line) + "\n" for line in lines), encoding="utf-8")
    tmp.replace(path)
    return path
