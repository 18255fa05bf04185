"""Pre-train the tiny omni model on tiny AVQA (supervised, teacher-forced answers) with label noise.

`odrl pretrain --omni` writes omni_diffusion_rl/assets/tiny_omni_base, the model GSPO starts from.
Fresh clips every step. The noise is systematic, as a careless annotator's would be: for some values
of each attribute the label is usually a fixed wrong one (a red clip is mostly labelled "purple"),
plus a little uniform noise everywhere. A model trained on such labels answers those values wrong
even greedily although its encoders see the difference, which leaves RL room on every question kind.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.tiny_omni import OMNI_BASE, TinyOmniConfig, TinyOmniModel, build_tokenizer
from ..tiny_clip import synthesize_audio
from ..world.avqa import WHEN_ANSWERS, Question, answer_options, questions, render_clips, vocabulary
from ..world.tiny_world import Scene
from .pretrain import learning_rate

CONFUSIONS: dict[str, dict[str, str]] = {
    "color": {"red": "purple", "blue": "cyan", "yellow": "green"},
    "shape": {"square": "circle"},
    "pitch": {"mid": "low"},
    "when": {"late": "early"},
}
"""The values a careless annotator labels as another one (scene attribute values: when is early/late)."""
CONFUSION_RATE, UNIFORM_RATE = 0.6, 0.1


def _noisy_value(attr: str, value: str, gen: torch.Generator, confusion: float, uniform: float) -> str:
    wrong = CONFUSIONS[attr].get(value)
    roll = torch.rand((), generator=gen).item()
    if wrong is not None and roll < confusion:
        return wrong
    if roll > 1 - uniform:
        options = answer_options(attr)
        pick = options[int(torch.randint(len(options), (1,), generator=gen))]
        inverse = {v: k for k, v in WHEN_ANSWERS.items()}
        return inverse[pick] if attr == "when" else pick
    return value


def noisy_answer(question: Question, gen: torch.Generator, confusion: float, uniform: float) -> str:
    """The label an annotator gives: the right answer with each attribute possibly confused."""
    scene = question.scene
    if question.kind == "describe":
        noisy = Scene(**{a: _noisy_value(a, getattr(scene, a), gen, confusion, uniform) for a in CONFUSIONS})
        return noisy.prompt
    value = _noisy_value(question.kind, getattr(scene, question.kind), gen, confusion, uniform)
    return WHEN_ANSWERS[value] if question.kind == "when" else value


def answer_tokens(model: TinyOmniModel, answers: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded answer ids with the end token [B, L] and their mask."""
    ids = [row + [model.eos_id] for row in model.tokenize(answers)]
    width = max(len(r) for r in ids)
    tokens = torch.tensor([r + [model.pad_id] * (width - len(r)) for r in ids])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in ids], dtype=torch.bool)
    return tokens, mask


def pretrain_omni_model(
    output_dir: str | Path = OMNI_BASE,
    steps: int = 1500,
    batch_size: int = 32,
    lr: float = 1e-3,
    confusion: float = CONFUSION_RATE,
    uniform: float = UNIFORM_RATE,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Train from scratch and save with save_pretrained; returns summary numbers."""
    from ..algorithms.gspo import answer_mean

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyOmniModel(TinyOmniConfig(), build_tokenizer(vocabulary()))
    pool = questions(heldout=False)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    start, loss_ema = time.time(), None
    bar = tqdm(range(steps), desc="pretrain tiny_omni", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        batch = [pool[int(i)] for i in torch.randint(len(pool), (batch_size,), generator=gen)]
        video, amps = render_clips(batch, gen)
        prompted = model.prompt(video, synthesize_audio(amps), model.tokenize([q.text for q in batch]))
        tokens, mask = answer_tokens(model, [noisy_answer(q, gen, confusion, uniform) for q in batch])
        loss = -answer_mean(model.answer_log_probs(prompted, tokens, mask), mask).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss_ema = loss.item() if loss_ema is None else 0.98 * loss_ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{loss_ema:.4f}")
    model.save_pretrained(output_dir)
    return {"final_loss": float(loss_ema or 0.0), "seconds": time.time() - start, "steps": steps}
