"""`odrl bench qwen-cost`: what a Qwen2.5-Omni rollout step spends before the language model, the
way it was and the way it is, side by side in one run.

- **Sound features** for 16 clips of 4 s at 16 kHz with the 7B model's Whisper settings (128 mels,
  hop 160, n_fft 400, chunk_length 300): padded to the extractor's chunk (the processor's
  `padding="max_length"`, as before) against padded to the clip (`qwen_omni.sound_features`, now).
  Seconds (median of interleaved rounds) and the features' MiB; the frames the towers read are
  the same bit for bit (tests/test_question_prompts.py).
- **Towers per group** on the tiny random-init thinker (`odrl tiny-qwen`): the prompt of 4 clips with
  8 answers each built from 32 copies of the clips (before) against from the 4 clips, repeated
  after the towers (`QwenPrompted.repeated`, now). Seconds and the rows through the towers.

Prints a table, writes JSON and a bar chart.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from statistics import median
from typing import Any

import torch

from .common import machine_info, publish
from .tiny_qwen import WHISPER_7B

CLIPS, SECONDS, RATE = 16, 4.0, WHISPER_7B["sampling_rate"]
GROUPS, GROUP_SIZE = 4, 8


def _timed(run: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = run()
    return time.perf_counter() - start, out


def features_cost(rounds: int) -> dict[str, Any]:
    """Sound features before (max length) and now (the clip), over interleaved rounds."""
    from transformers import WhisperFeatureExtractor

    from ..models.qwen_omni import sound_features

    fe = WhisperFeatureExtractor(**WHISPER_7B)
    waves = torch.randn(CLIPS, 1, int(SECONDS * RATE), generator=torch.Generator().manual_seed(0)) * 0.1

    def before() -> torch.Tensor:
        sounds = [w.mean(0).numpy() for w in waves]
        kwargs = {"sampling_rate": RATE, "padding": "max_length", "truncation": True, "return_tensors": "pt"}
        return fe(sounds, return_attention_mask=True, **kwargs)["input_features"]

    def now() -> torch.Tensor:
        return sound_features(fe, waves)[0]

    seconds: dict[str, list[float]] = {"before": [], "now": []}
    shapes = {}
    for r in range(rounds):
        for name, run in (
            (("before", before), ("now", now)) if r % 2 == 0 else (("now", now), ("before", before))
        ):
            took, features = _timed(run)
            seconds[name].append(took)
            shapes[name] = list(features.shape)
    return {
        name: {
            "seconds": round(median(times), 4),
            "mib": round(_numel(shapes[name]) * 4 / 2**20, 1),
            "shape": shapes[name],
        }
        for name, times in seconds.items()
    }


def _numel(shape: list[int]) -> int:
    out = 1
    for side in shape:
        out *= side
    return out


def towers_cost(rounds: int) -> dict[str, Any]:
    """A group's prompt from k copies of its clip (before) against from the clip once (now)."""
    from ..models.qwen_omni import QwenOmniModel
    from .tiny_qwen import save_tiny_qwen_omni

    with tempfile.TemporaryDirectory() as folder:
        model = QwenOmniModel.from_pretrained(
            save_tiny_qwen_omni(Path(folder)), fps=8.0, seconds=0.5, frame_size=28
        )
    clip = model.clip_format
    gen = torch.Generator().manual_seed(0)
    video = torch.rand(GROUPS, clip.frames, 3, 28, 28, generator=gen)
    audio = torch.randn(GROUPS, 1, clip.samples, generator=gen) * 0.1
    questions = model.tokenize(["which colour is the shape ?"] * GROUPS)
    k = GROUP_SIZE
    many = [q for q in questions for _ in range(k)]

    @torch.no_grad()
    def before() -> Any:
        return model.prompt(video.repeat_interleave(k, 0), audio.repeat_interleave(k, 0), many)

    @torch.no_grad()
    def now() -> Any:
        return model.prompt(video, audio, questions).repeated(k)

    seconds: dict[str, list[float]] = {"before": [], "now": []}
    outputs = {}
    for r in range(rounds):
        for name, run in (
            (("before", before), ("now", now)) if r % 2 == 0 else (("now", now), ("before", before))
        ):
            took, outputs[name] = _timed(run)
            seconds[name].append(took)
    gap = float((outputs["before"].embeds - outputs["now"].embeds).abs().max())
    rows = {"before": GROUPS * k, "now": GROUPS}
    result = {name: {"seconds": round(median(t), 4), "tower_rows": rows[name]} for name, t in seconds.items()}
    return result | {"prompt_embedding_max_difference": gap}


def run_qwen_cost_bench(output: Path, rounds: int = 5) -> dict[str, Any]:
    features, towers = features_cost(rounds), towers_cost(rounds)
    result = {
        "machine": machine_info(),
        "rounds": rounds,
        "features": features
        | {"ratio_seconds": _ratio(features, "seconds"), "ratio_mib": _ratio(features, "mib")},
        "towers": towers | {"ratio_seconds": _ratio(towers, "seconds")},
    }
    publish(result, output, format_table(result), _draw, (8.0, 3.5), panels=2)
    return result


def _ratio(part: dict[str, Any], key: str) -> float:
    return round(part["before"][key] / part["now"][key], 2) if part["now"][key] else float("inf")


def format_table(result: dict[str, Any]) -> str:
    f, t = result["features"], result["towers"]
    rows = [
        f"{'':<44}{'before':>12}{'now':>12}{'before/now':>12}",
        f"{'sound features, 16 clips x 4 s: seconds':<44}"
        f"{f['before']['seconds']:>12}{f['now']['seconds']:>12}"
        f"{f['ratio_seconds']:>12}",
        f"{'sound features: MiB':<44}{f['before']['mib']:>12}{f['now']['mib']:>12}{f['ratio_mib']:>12}",
        f"{'prompt of 4 groups x 8 (tiny): seconds':<44}{t['before']['seconds']:>12}{t['now']['seconds']:>12}"
        f"{t['ratio_seconds']:>12}",
        f"{'rows through the towers':<44}{t['before']['tower_rows']:>12}{t['now']['tower_rows']:>12}",
    ]
    return "\n".join(rows)


def _draw(axes: list[Any], result: dict[str, Any]) -> None:
    for ax, (part, title) in zip(
        axes, (("features", "sound features"), ("towers", "prompt, 4 groups x 8")), strict=True
    ):
        values = [result[part]["before"]["seconds"], result[part]["now"]["seconds"]]
        ax.bar(["before", "now"], values, color=["#999999", "#3366cc"])
        ax.set_title(title)
        ax.set_ylabel("seconds (median)")
