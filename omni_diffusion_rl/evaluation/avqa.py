"""Held-out accuracy of an answering model on tiny AVQA: exact answers, greedy and sampled, overall
and per question kind. Clips and sampling noise are keyed by the seed, so two models are compared on
the same clips and the same random numbers."""

from __future__ import annotations

from collections import defaultdict

import torch

from ..experience.rollout import step_generator
from ..experience.text_sampling import sample_answers
from ..models.tiny_omni import TinyOmniModel
from ..world.avqa import Question, exact_match, questions, render_clips
from ..world.tiny_clip import synthesize_audio


@torch.no_grad()
def answer_questions(
    model: TinyOmniModel,
    batch: list[Question],
    seed: int,
    greedy: bool,
    max_new_tokens: int = 16,
    temperature: float = 1.0,
) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The model's answers to `batch` and the clips they are about (video, waveform): each clip and
    sampling stream keyed by (seed, position)."""
    gens = [step_generator(seed, 0, i, "eval") for i in range(len(batch))]
    rendered = [render_clips([q], g) for q, g in zip(batch, gens, strict=True)]
    video, amps = torch.cat([v for v, _ in rendered]), torch.cat([a for _, a in rendered])
    audio = synthesize_audio(amps)
    device = next(model.parameters()).device
    prompted = model.prompt(video.to(device), audio.to(device), model.tokenize([q.text for q in batch]))
    out = sample_answers(
        model.lm,
        prompted.embeds,
        prompted.mask,
        model.eos_id,
        model.pad_id,
        max_new_tokens,
        temperature,
        greedy=greedy,
        generators=None if greedy else gens,
    )
    texts = [
        model.tokenizer.decode(row[m].tolist(), skip_special_tokens=True)
        for row, m in zip(out.tokens, out.mask, strict=True)
    ]
    return texts, video, audio


def avqa_accuracy(
    model: TinyOmniModel,
    pool: list[Question] | None = None,
    repeats: int = 4,
    seed: int = 0,
    max_new_tokens: int = 16,
) -> dict[str, float]:
    """{greedy, sampled, greedy/<kind>, sampled/<kind>}: the share of exact answers over `pool`
    (default: every held-out question), each asked `repeats` times on fresh clips."""
    pool = [q for q in (questions(heldout=True) if pool is None else pool) for _ in range(repeats)]
    was_training = model.training
    model.eval()
    out: dict[str, float] = {}
    try:
        for mode in ("greedy", "sampled"):
            answers, _, _ = answer_questions(model, pool, seed, mode == "greedy", max_new_tokens)
            by_kind: dict[str, list[float]] = defaultdict(list)
            for q, a in zip(pool, answers, strict=True):
                by_kind[q.kind].append(exact_match(a, q))
            scores = [s for v in by_kind.values() for s in v]
            out[mode] = sum(scores) / len(scores)
            out |= {f"{mode}/{k}": sum(v) / len(v) for k, v in sorted(by_kind.items())}
    finally:
        model.train(was_training)
    return out
