"""Pre-train the tiny base model on synthetic tiny-world clips (plain flow matching).

`odrl pretrain` writes the result to omni_diffusion_rl/assets/tiny_av_base, the model that
post-training starts from. Every step draws fresh clips; label noise per attribute makes the model
follow each attribute of a prompt only partly, so post-training has room on all four. The weights
saved are an exponential moving average of the trained ones (cleaner samples, as usual for
diffusion models).
"""

from __future__ import annotations

import copy
import inspect
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..algorithms.nft import flow_matching_loss
from ..models.folder_card import (
    GUIDANCE_FILE,
    TRAINED_PARTS_FILE,
    checked_guidance,
    write_folder_guidance,
    write_trained_parts,
)
from ..models.tiny_av import BUILTIN_WEIGHTS, TEACHER_GUIDANCE, TinyAVPolicy, TinyAVTransformer
from ..teacher import part_names_problem
from . import tiny_world as world

# Chosen by measurement (docs/tiny-world.md): base accuracy well below what post-training
# reaches on every attribute, and clean, recognisable clips.
DEFAULT_LABEL_NOISE = {"color": 0.5, "shape": 0.5, "pitch": 0.5, "when": 0.5}
TEACHER_STEPS = 12000
"""The tiny teacher's pretraining steps (`odrl pretrain --teacher`): held-out all four right 0.980 at
guidance 3, against 0.906 after 6,000 (docs/algorithms.md)."""
TEACHER_RECIPE: dict[str, object] = {
    "label_noise": 0.0,
    "dim": 128,
    "depth": 6,
    "heads": 4,
    "prompt_dropout": 0.1,
    "guidance": TEACHER_GUIDANCE,
}
"""The tiny teacher: clean labels and about 2.7x the base's compute per forward (dim 128 x 6 blocks
against 96 x 4), so it knows every attribute and its time is a real share of a distillation step;
one clip in ten on the empty prompt, so that it is sampled and asked with guidance, which its folder
recommends (guidance.json: models.tiny_av.TEACHER_GUIDANCE)."""


def check_pretrain_options(
    prompt_dropout: float = 0.0,
    guidance: float | None = None,
    parts: list[str] | None = None,
    **model_config: object,
) -> None:
    """Refuse, before any training, options that cannot work (ValueError naming the fix)."""
    if not 0.0 <= prompt_dropout < 1.0:
        raise ValueError(f"prompt_dropout={prompt_dropout}: give a share in [0, 1), e.g. 0.1")
    if guidance is not None and guidance != 1.0 and prompt_dropout == 0:
        raise ValueError(
            f"guidance={guidance} needs a model trained on the empty prompt: set prompt_dropout, e.g. 0.1"
        )
    defaults = {k: p.default for k, p in inspect.signature(TinyAVTransformer.__init__).parameters.items()}
    size = {key: model_config.get(key, defaults[key]) for key in ("dim", "depth", "heads")}
    if any(not isinstance(v, int) or v < 1 for v in size.values()):
        raise ValueError(f"dim, depth and heads must be positive whole numbers; got {size}")
    if size["dim"] % size["heads"]:  # type: ignore[operator]
        raise ValueError(f"dim {size['dim']} must be a multiple of heads {size['heads']}")
    if guidance is not None:
        checked_guidance({"cfg_scale": guidance}, Path("guidance"))
    if parts is not None:
        problem = part_names_problem(parts)
        if problem:
            raise ValueError(f"--parts: {problem}")
        layout = {k: v for k, v in model_config.items() if k not in ("dim", "depth", "heads", "label_noise")}
        trained_entries(TinyAVTransformer(**layout).layout.parts(), parts)  # type: ignore[arg-type]


def trained_entries(layout_parts: dict[str, tuple[int, int]], parts: list[str] | None) -> torch.Tensor:
    """The latent entries pretraining learns: every one, or those of the named parts."""
    if parts is None:
        return torch.arange(max(stop for _, stop in layout_parts.values()))
    unknown = sorted(set(parts) - set(layout_parts))
    if unknown or not parts:
        raise ValueError(f"parts {unknown or parts}: the latent's parts are {', '.join(layout_parts)}")
    return torch.cat([torch.arange(*layout_parts[p]) for p in parts])


def learning_rate(step: int, steps: int, peak: float, warmup: int = 100, decay_from: float = 0.7) -> float:
    """Linear warm-up, constant, then linear decay to 5% over the last 30% of the steps."""
    if step < warmup:
        return peak * (step + 1) / warmup
    start = int(steps * decay_from)
    if step < start:
        return peak
    return peak * max(0.05, (steps - step) / max(1, steps - start))


def flow_matching_step(
    policy: Any,
    average: torch.nn.Module,
    opt: torch.optim.Optimizer,
    prompts: list[str],
    x0: torch.Tensor,
    gen: torch.Generator,
    ema_decay: float,
    entries: torch.Tensor | None = None,
) -> float:
    """One plain flow-matching step of `policy.transformer` on clips `x0` for `prompts` (noise and
    logit-normal times from `gen`; the loss over `entries` of the latent, or all of it), gradients
    clipped to norm 1, then `average` moved toward the trained weights; returns the loss."""
    transformer = policy.transformer
    noise = torch.randn(x0.shape, generator=gen)
    t = torch.sigmoid(torch.randn(len(x0), generator=gen))  # logit-normal times
    x_t = (1 - t[:, None]) * x0 + t[:, None] * noise
    v = policy.velocity(x_t, t, policy.encode_prompts(prompts))
    keep = slice(None) if entries is None else entries
    loss = flow_matching_loss(v[:, keep], noise[:, keep], x0[:, keep])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(transformer.parameters(), 1.0)
    opt.step()
    with torch.no_grad():
        for kept, trained in zip(average.parameters(), transformer.parameters(), strict=True):
            kept.lerp_(trained, 1 - ema_decay)
    return loss.item()


def pretrain_base_model(
    output_dir: str | Path = BUILTIN_WEIGHTS,
    steps: int = 6000,
    batch_size: int = 64,
    label_noise: dict[str, float] | float | None = None,
    lr: float = 1e-3,
    ema_decay: float = 0.998,
    seed: int = 0,
    progress: bool = True,
    parts: list[str] | None = None,
    prompt_dropout: float = 0.0,
    guidance: float | None = None,
    **model_config: object,
) -> dict[str, float]:
    """Train from scratch and save the moving average with save_pretrained; returns summary numbers.
    `parts`: learn only these parts of the latent (a video-only or audio-only teacher, for
    teacher.routes); the others' velocity is left untrained. `prompt_dropout`: the share of clips
    trained on the empty prompt, so that it can be sampled with classifier-free guidance; `guidance`:
    the guidance written to the folder as its recommended one (guidance.json), which needs it."""
    check_pretrain_options(prompt_dropout=prompt_dropout, guidance=guidance, parts=parts, **model_config)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    noise_levels = DEFAULT_LABEL_NOISE if label_noise is None else label_noise
    transformer = TinyAVTransformer(**model_config)  # type: ignore[arg-type]
    policy = TinyAVPolicy(transformer)
    entries = trained_entries(transformer.layout.parts(), parts)
    average = copy.deepcopy(transformer).requires_grad_(False)
    opt = torch.optim.AdamW(transformer.parameters(), lr=lr, weight_decay=1e-4)
    start, loss_ema = time.time(), None
    bar = tqdm(range(steps), desc="pretrain tiny_av", disable=not progress)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, steps, lr)
        prompts, video, amps = world.synthetic_clips(batch_size, gen, noise_levels)
        if prompt_dropout > 0:
            dropped = torch.rand(batch_size, generator=gen) < prompt_dropout
            prompts = ["" if drop else prompt for prompt, drop in zip(prompts, dropped.tolist(), strict=True)]
        x0 = transformer.layout.encode(video, amps)
        loss = flow_matching_step(policy, average, opt, prompts, x0, gen, ema_decay, entries)
        loss_ema = loss if loss_ema is None else 0.98 * loss_ema + 0.02 * loss
        bar.set_postfix(loss=f"{loss_ema:.4f}")
    for stale in (GUIDANCE_FILE, TRAINED_PARTS_FILE):  # an earlier model's word must not outlive it
        (Path(output_dir) / stale).unlink(missing_ok=True)
    if parts is not None:  # the other parts' heads are untrained: say so, for teacher.routes' checks
        write_trained_parts(output_dir, parts)
    average.save_pretrained(output_dir)
    if guidance is not None and guidance != 1.0:
        write_folder_guidance(output_dir, guidance)
    return {"final_loss": float(loss_ema), "seconds": time.time() - start, "steps": steps}
