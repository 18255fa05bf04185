"""Pre-train the tiny omni model in three stages, as omni models are: its media encoder first, alone,
on clean labels (linear heads read each attribute of the clip from the encoder's output and are then
dropped), then the whole model on tiny AVQA (supervised, teacher-forced answers) with clean answers,
then with the label noise of a careless annotator.

`odrl pretrain --omni` writes omni_diffusion_rl/assets/tiny_omni_base, the model GSPO starts from.
Fresh clips every step, from the training scenes only. The noise is systematic, as a careless
annotator's would be: for some values of each attribute the label is usually a fixed wrong one (a
red clip is mostly labelled "purple"), plus a little uniform noise everywhere. A model trained on
such labels answers those values wrong even greedily although its encoder sees the difference
(checked by a probe: tests/test_tiny_omni.py), which leaves RL room on every question kind.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..models.tiny_omni import OMNI_BASE, TinyOmniConfig, TinyOmniModel, build_tokenizer
from .avqa import WHEN_ANSWERS, Question, answer_options, questions, render_clips, vocabulary
from .pretrain import learning_rate
from .tiny_clip import synthesize_audio
from .tiny_world import COLORS, PITCH_BINS, SHAPES, WHEN_PHRASES, Scene

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


ATTRIBUTE_VALUES: dict[str, tuple[str, ...]] = {
    "color": tuple(COLORS),
    "shape": SHAPES,
    "pitch": tuple(PITCH_BINS),
    "when": tuple(WHEN_PHRASES),
}


def pretrain_media_encoder(
    encoder: torch.nn.Module,
    scenes: list[Scene],
    steps: int,
    gen: torch.Generator,
    batch_size: int = 64,
    lr: float = 1e-3,
    progress: bool = True,
) -> dict[str, float]:
    """Stage one: the encoder learns to tell each attribute of a clip from clean labels, through one
    linear head per attribute over all its output tokens (the heads are dropped). Without it the
    shape, a few corner pixels, is lost under the later noisy answers: the base then cannot tell a
    circle from a square and no reward can teach it to. Returns each attribute's accuracy on the
    last batch."""
    from .avqa import Question

    width = encoder.num_tokens * encoder.types.shape[1]
    heads = torch.nn.ModuleDict({k: torch.nn.Linear(width, len(v)) for k, v in ATTRIBUTE_VALUES.items()})
    opt = torch.optim.AdamW([*encoder.parameters(), *heads.parameters()], lr=lr, weight_decay=1e-4)
    accuracy: dict[str, float] = {}
    for step in tqdm(range(steps), desc="pretrain tiny_omni encoder", disable=not progress):
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        batch = [scenes[int(i)] for i in torch.randint(len(scenes), (batch_size,), generator=gen)]
        video, amps = render_clips([Question(s, "describe") for s in batch], gen)
        tokens = encoder(video, synthesize_audio(amps))
        # normalised per token, as the LM's first norm layer sees them: an attribute must stand out
        # at that scale, not only in a direction a head could rescale
        features = torch.nn.functional.rms_norm(tokens, (tokens.shape[-1],)).flatten(1)
        loss = torch.zeros(())
        for attr, values in ATTRIBUTE_VALUES.items():
            target = torch.tensor([values.index(getattr(s, attr)) for s in batch])
            logits = heads[attr](features)
            loss = loss + torch.nn.functional.cross_entropy(logits, target)
            accuracy[attr] = float((logits.argmax(-1) == target).float().mean())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return accuracy


def train_answers(
    model: TinyOmniModel,
    pool: list[Question],
    steps: int,
    gen: torch.Generator,
    confusion: float,
    uniform: float,
    batch_size: int = 32,
    lr: float = 1e-3,
    desc: str = "pretrain tiny_omni",
    progress: bool = True,
) -> float:
    """Teacher-forced answers for `steps` steps (labels with the given noise), a fresh optimizer and
    learning-rate schedule; returns the loss's moving average at the end."""
    from ..algorithms.gspo import answer_mean

    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=1e-4)
    loss_ema = None
    bar = tqdm(range(steps), desc=desc, disable=not progress)
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
    return float(loss_ema or 0.0)


def pretrain_omni_model(
    output_dir: str | Path = OMNI_BASE,
    steps: int = 1500,
    encoder_steps: int = 2500,
    align_steps: int = 600,
    confusion: float = CONFUSION_RATE,
    uniform: float = UNIFORM_RATE,
    seed: int = 0,
    progress: bool = True,
) -> dict[str, float]:
    """Train from scratch in three stages and save with save_pretrained; returns summary numbers.
    1. the media encoder alone on clean attribute labels (`encoder_steps`);
    2. the whole model on clean answers (`align_steps`): the LM learns to read every attribute from
       the encoder's tokens (with noisy answers only it never learns to read the shape);
    3. the whole model on the annotator's noisy answers (`steps`): it keeps reading the clip (a probe
       on its state tells the shapes apart) but answers the confused values wrong."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    model = TinyOmniModel(TinyOmniConfig(), build_tokenizer(vocabulary()))
    pool = questions(heldout=False)
    start = time.time()
    scenes = sorted({q.scene for q in pool}, key=lambda s: s.prompt)
    encoder_accuracy = pretrain_media_encoder(model.encoder, scenes, encoder_steps, gen, progress=progress)
    align_loss = train_answers(
        model, pool, align_steps, gen, 0.0, 0.0, desc="align tiny_omni", progress=progress
    )
    final_loss = train_answers(model, pool, steps, gen, confusion, uniform, progress=progress)
    model.save_pretrained(output_dir)
    return {
        "final_loss": final_loss,
        "align_loss": align_loss,
        "seconds": time.time() - start,
        "steps": steps,
        "align_steps": align_steps,
        "encoder_steps": encoder_steps,
        **{f"encoder_accuracy/{k}": v for k, v in encoder_accuracy.items()},
    }
