"""What `odrl eval` evaluates: the world's own clips, a base model, or a training checkpoint.

Each target becomes a `MediaMaker` (held-out prompts and noise -> media) and is run through the
same held-out evaluation as training's before/after (`evaluation.evaluate_heldout`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint import MANIFEST, CheckpointError, load_checkpoint, resolve_checkpoint
from .config import (
    ConfigError,
    ExperimentConfig,
    _set_dotted,
    _yaml,
    check_input_file,
    config_from_dict,
    parse_override,
    read_text_bounded,
)
from .evaluation import MediaMaker, build_metrics, evaluate_heldout
from .media import MediaBatch
from .prompts import load_prompts
from .reward_factory import reward_from_config
from .rollout import generate

WORLD = "world"
BASE = ("base", "builtin")
EVAL_SECTIONS = ("data", "eval", "sampling", "reward")  # what a --config file sets for a checkpoint


def is_checkpoint(path: Path) -> bool:
    return (path / MANIFEST).is_file() or (path / "latest").is_file()


def target_config(target: str, config_path: str | None, overrides: list[str]) -> ExperimentConfig:
    """The config a target is evaluated with. A checkpoint brings its own (the model it was trained
    on); a --config file's data, eval, sampling and reward sections and the overrides go on top.
    Other targets use the --config file (or the defaults) and the overrides."""
    data: dict[str, Any] = {}
    if config_path is not None:
        path = Path(config_path)
        check_input_file(path, "config file")
        data = _yaml(read_text_bounded(path)) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path} holds a {type(data).__name__}, not a mapping of sections")
    if target not in (WORLD, *BASE) and is_checkpoint(Path(target)):
        _, _, state = load_checkpoint(target, objects=False)
        saved = state.get("config")
        if not isinstance(saved, dict) or not isinstance(saved.get("model"), dict):
            raise CheckpointError(f"checkpoint {target} has no model configuration in its state.json")
        # A shared checkpoint names no code to import: its reward.plugins are left out (give them with
        # --config or reward.plugins=[...] to score with a plug-in reward).
        reward = saved.get("reward") if isinstance(saved.get("reward"), dict) else {}
        saved = {**saved, "reward": {k: v for k, v in reward.items() if k != "plugins"}}
        data = {**saved, **{k: v for k, v in data.items() if k in EVAL_SECTIONS}}
    for text in overrides:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return config_from_dict(data)


def prepare_target(target: str, cfg: ExperimentConfig) -> tuple[MediaMaker, tuple[int, ...]]:
    """The target's media maker and the latent shape of its noise."""
    if target == WORLD:
        return _world_maker(cfg)
    from .inference import load_policy
    from .models import build_policy

    if target in BASE:
        policy, _ = build_policy(cfg.model)
    else:
        path = Path(target)
        if not path.exists():
            raise CheckpointError(
                f"{target} does not exist; give a run's checkpoints/ folder, a step_* folder, a "
                "save_pretrained model directory, base or world"
            )
        if is_checkpoint(path):
            policy = load_policy(resolve_checkpoint(path))
        elif (path / "config.json").is_file():
            policy, _ = build_policy(type(cfg.model)(**{**cfg.model.__dict__, "pretrained": str(path)}))
        else:
            raise CheckpointError(
                f"{target} is neither a training checkpoint (no {MANIFEST} or latest file) nor a model "
                "directory (no config.json); give a run's checkpoints/ folder, a step_* folder, a "
                "save_pretrained model directory, base or world"
            )
    s = cfg.sampling

    @torch.no_grad()
    def make(prompts: list[str], noise: torch.Tensor) -> MediaBatch:
        rollout = generate(
            policy, prompts, list(range(len(prompts))), noise, s.eval_num_steps, s.time_shift, s.solver
        )
        return policy.decode(rollout.x0)

    return make, tuple(policy.latent_shape)


def _world_maker(cfg: ExperimentConfig) -> tuple[MediaMaker, tuple[int, ...]]:
    from .world import tiny_world as world

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
    """A target's held-out summary: the training reward (unless `with_reward` is off) and the eval
    metrics, on the config's held-out prompts, sample count and sampler."""
    make, latent_shape = prepare_target(target, cfg)
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
