"""What `odrl eval` evaluates: the world's own clips, a base model, or a training checkpoint.

A media generator becomes a `MediaMaker` (held-out prompts and noise -> media) and is run through
the same held-out evaluation as training's before/after (`evaluation.evaluate_heldout`); an
answering model (GSPO's tiny omni) is scored by the held-out exact-answer accuracy training logs
(`evaluate_answers`).

A checkpoint is untrusted: it contributes its model section (which model its adapters belong to,
checked by `checkpoint.checkpoint_model`) and its sampling section (how it samples, bounded) and
nothing else. The data, reward and eval sections, which name files to read, servers, tokens and
plug-ins, come from the user's --config and overrides, else from this package's defaults for the
model's family (`FAMILY_EVAL_DEFAULTS`), never from the checkpoint.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import MANIFEST, CheckpointError, checkpoint_model, checkpoint_sampling, load_checkpoint
from ..config import (
    ConfigError,
    ExperimentConfig,
    SamplingConfig,
    _set_dotted,
    config_from_dict,
    parse_override,
    read_config_file,
)
from ..experience.rollout import generate_for_eval
from ..media import MediaBatch
from ..prompts import load_prompts, ready_to_answer, split_prompts
from ..reward_factory import reward_from_config
from .heldout import MediaMaker, build_metrics, evaluate_heldout

WORLD = "world"
BASE = ("base", "builtin")
ANSWER_EVAL: dict[str, dict[str, Any]] = {
    "algorithm": {"name": "gspo"},  # its answer options (max_new_tokens) are GSPO's
    "data": {"eval_prompts": "builtin:tiny_avqa_heldout"},
    "reward": {"weights": {"avqa_exact": 1.0, "answer_format": 0.5}},
    "eval": {"metrics": []},
}
"""An answering model's evaluation: tiny AVQA's held-out questions, the GSPO recipe's rewards, and
GSPO's answer options (algorithm.max_new_tokens)."""
FAMILY_EVAL_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {"tiny_av": {}, "tiny_omni": ANSWER_EVAL}
"""This package's evaluation settings by model family, under the --config file and the overrides:
tiny_av the config defaults (the tiny world's held-out prompts, reward and judge), tiny_omni
ANSWER_EVAL, any other family the config defaults without the judge (OTHER_FAMILY_EVAL: it judges
tiny-world clips only)."""
OTHER_FAMILY_EVAL: dict[str, dict[str, Any]] = {"eval": {"metrics": []}}


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / "latest").is_file()


def _user_config(config_path: str | None) -> dict[str, Any]:
    """The sections of the --config file (empty without one), read by config.py's checked loader."""
    return read_config_file(config_path) if config_path is not None else {}


def _checkpoint_sections(target: str, user: dict[str, Any]) -> dict[str, Any]:
    """The user's sections with the checkpoint's checked model section, and its sampling section
    unless the user's config has one. Nothing else of the checkpoint's config is read."""
    _, _, state = load_checkpoint(target, objects=False)
    sections = {**user, "model": dataclasses.asdict(checkpoint_model(state, target))}
    if "sampling" not in user:
        sections["sampling"] = dataclasses.asdict(checkpoint_sampling(state, target))
    return sections


def _layered(base: dict[str, dict[str, Any]], top: dict[str, Any]) -> dict[str, Any]:
    """`top` over `base`, section by section and key by key."""
    out = dict(top)
    for name, section in base.items():
        given = top.get(name, {})
        out[name] = {**section, **given} if isinstance(given, dict) else given
    return out


def target_config(target: str, config_path: str | None, overrides: list[str]) -> ExperimentConfig:
    """The config a target is evaluated with: the --config file (or none) and the overrides, over
    this package's defaults for the model's family. A checkpoint sets the model section (the one it
    was trained with; overrides still apply) and, unless --config has one, the sampling section."""
    data = _user_config(config_path)
    if target not in (WORLD, *BASE) and is_checkpoint(Path(target)):
        data = _checkpoint_sections(target, data)
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    model = data.get("model")
    family = model.get("family", "tiny_av") if isinstance(model, dict) else "tiny_av"
    return config_from_dict(_layered(FAMILY_EVAL_DEFAULTS.get(family, OTHER_FAMILY_EVAL), data))


def target_policy(target: str, cfg: ExperimentConfig) -> Any:
    """The policy a target (not 'world') names: the base cfg.model names, a save_pretrained model
    directory, or a checkpoint's trained adapter on the base cfg.model names (fingerprint checked)."""
    from ..inference import read_trained, trained_policy
    from ..models import build_policy

    if target in BASE:
        return build_policy(cfg.model)[0]
    path = Path(target)
    if not path.exists():
        raise CheckpointError(
            f"{target} does not exist; give a run's checkpoints/ folder, a step_* folder, a "
            "save_pretrained model directory, base or world"
        )
    if is_checkpoint(path):
        return trained_policy(read_trained(path), cfg.model)
    if (path / "config.json").is_file():
        return build_policy(dataclasses.replace(cfg.model, pretrained=str(path)))[0]
    raise CheckpointError(
        f"{target} is neither a training checkpoint (no {MANIFEST} or latest file) nor a model "
        "directory (no config.json); give a run's checkpoints/ folder, a step_* folder, a "
        "save_pretrained model directory, base or world"
    )


def _policy_maker(policy: Any, s: SamplingConfig) -> MediaMaker:
    @torch.no_grad()
    def make(prompts: list[str], noise: torch.Tensor) -> MediaBatch:
        return policy.decode(generate_for_eval(policy, prompts, noise, s).x0)

    return make


def _world_maker(cfg: ExperimentConfig) -> tuple[MediaMaker, tuple[int, ...]]:
    from ..world import tiny_world as world

    if cfg.model.family != "tiny_av":
        raise ConfigError(f"target 'world' is the tiny world's renders; model.family is {cfg.model.family}")
    gen = torch.Generator().manual_seed(0)  # batches come in a fixed order: the renders are fixed

    def make(prompts: list[str], noise: torch.Tensor) -> MediaBatch:
        rendered = world.render_prompts(prompts, gen)
        if rendered is None:
            raise ConfigError("target 'world' renders tiny-world prompts only; data.eval_prompts has others")
        video, audio = rendered
        return MediaBatch(video=video, audio=audio, fps=world.FPS, sample_rate=world.SAMPLE_RATE)

    return make, (1,)  # the renders do not use the noise


def evaluate_target(target: str, cfg: ExperimentConfig, with_reward: bool = True) -> dict[str, float]:
    """A target's held-out summary on the config's held-out prompts, sample count and sampler: the
    training reward (unless `with_reward` is off) and the eval metrics of a media generator, the
    exact-answer accuracy (and reward) of an answering model."""
    if target == WORLD:
        return _evaluate_media(*_world_maker(cfg), cfg, with_reward)
    policy = target_policy(target, cfg)
    if getattr(policy, "kind", None) == "answers":
        return evaluate_answers(policy, cfg, with_reward)
    return _evaluate_media(_policy_maker(policy, cfg.sampling), tuple(policy.latent_shape), cfg, with_reward)


def _evaluate_media(
    make: MediaMaker, latent_shape: tuple[int, ...], cfg: ExperimentConfig, with_reward: bool
) -> dict[str, float]:
    reward = reward_from_config(cfg.reward) if with_reward else None
    metrics = build_metrics(cfg.eval.metrics, cfg.eval.options)
    try:
        return evaluate_heldout(
            make, load_prompts(cfg.data.eval_prompts), cfg.data.eval_samples, latent_shape, reward, metrics
        )
    finally:
        if reward is not None:
            reward.close()
        for metric in metrics:
            metric.close()


def _questions(cfg: ExperimentConfig) -> list[str]:
    """The held-out prompts, each checked to name a question (tiny AVQA or a question file's line;
    one that names none is refused by its line number, never echoed)."""
    from ..answer_data.questions import question_text

    prompts = split_prompts(cfg.data, "heldout")
    for i, prompt in enumerate(prompts, 1):
        try:
            question_text(prompt, cfg.data.questions)
        except ValueError as e:
            raise ConfigError(
                f"data.eval_prompts={cfg.data.eval_prompts}: prompt {i} is not a question ('<kind> | "
                "<tiny-world prompt>' or a question file's line); an answering model is evaluated on "
                "questions, e.g. data.eval_prompts=builtin:tiny_avqa_heldout"
            ) from e
    return prompts


@torch.no_grad()
def evaluate_answers(policy: Any, cfg: ExperimentConfig, with_reward: bool = True) -> dict[str, float]:
    """An answering policy's held-out accuracy, greedy and sampled, overall and per category
    (accuracy/...), and the training reward of its greedy answers (reward, reward/...): what the
    trainer logs as eval/..., on the same questions, clips and random numbers (train.seed)."""
    from ..answer_data.style import QuestionStyle
    from .avqa import evaluate_answering

    if cfg.eval.metrics:
        raise ConfigError(
            f"eval.metrics={cfg.eval.metrics}: an answering model is scored by its exact answers; media "
            "metrics do not apply (set eval.metrics=[])"
        )
    ready_to_answer(cfg.data, cfg.model.family, policy)
    prompts = _questions(cfg)
    reward = reward_from_config(cfg.reward) if with_reward else None
    try:
        data = cfg.data
        limit = cfg.algorithm.max_new_tokens
        return evaluate_answering(
            policy.model,
            prompts,
            reward,
            data.eval_samples,
            cfg.train.seed,
            limit,
            data.questions,
            QuestionStyle.of(data),
        )
    finally:
        if reward is not None:
            reward.close()
