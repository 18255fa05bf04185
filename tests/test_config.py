"""Typed configs: YAML plus dotted overrides; bad input names the key and what is allowed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from omni_diffusion_rl.config import (
    ConfigError,
    ExperimentConfig,
    config_from_dict,
    load_config,
    parse_override,
)

from .helpers import REPO

YAML = """\
# a recipe
algorithm:
  beta: 0.1
  adv_mode: binary
  timestep_fraction: 1
data:
  group_size: 4
reward:
  weights: {color_match: 2.0, av_sync: 1}
sampling:
  solver: euler
"""


def _write(tmp_path: Path, text: str | bytes, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_load_config_from_yaml_and_overrides(tmp_path: Path) -> None:
    overrides = ["algorithm.beta=0.5", "train.steps=3", "sampling.solver=heun", "model.lora_rank=4"]
    cfg = load_config(_write(tmp_path, YAML), overrides)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.algorithm.beta == 0.5  # the override wins over the file
    assert cfg.algorithm.adv_mode == "binary"
    assert cfg.algorithm.timestep_fraction == 1.0 and isinstance(cfg.algorithm.timestep_fraction, float)
    assert cfg.data.group_size == 4
    assert cfg.train.steps == 3
    assert cfg.sampling.solver == "heun"
    assert cfg.model.lora_rank == 4
    assert cfg.reward.weights == {"color_match": 2.0, "av_sync": 1.0}
    assert all(isinstance(w, float) for w in cfg.reward.weights.values())
    # Untouched keys keep their defaults.
    assert cfg.algorithm.adv_clip_max == ExperimentConfig().algorithm.adv_clip_max == 5.0
    assert cfg.data.prompts == "builtin:tiny_world"
    assert cfg.to_dict()["algorithm"]["beta"] == 0.5


def test_defaults_without_file() -> None:
    cfg = load_config()
    assert cfg == ExperimentConfig()
    assert load_config(None, []) == cfg


def test_empty_yaml_file_gives_defaults(tmp_path: Path) -> None:
    assert load_config(_write(tmp_path, "# nothing\n")) == ExperimentConfig()


def test_parse_override_reads_yaml_values() -> None:
    assert parse_override("algorithm.beta=0.1") == ("algorithm.beta", 0.1)
    assert parse_override("train.steps=3") == ("train.steps", 3)
    assert parse_override("tracking.run_name=") == ("tracking.run_name", "")
    assert parse_override("model.lora_targets=[a, b]") == ("model.lora_targets", ["a", "b"])
    with pytest.raises(ConfigError, match="section.key=value"):
        parse_override("algorithm.beta")


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    return str(info.value)


@pytest.mark.parametrize(
    ("override", "fragments"),
    [
        # unknown keys, top level and nested: the message lists the allowed keys
        ("algo.beta=1", ["'algo'", "top level", "algorithm", "sampling"]),
        ("algorithm.betta=1", ["'algorithm.betta'", "section 'algorithm'", "beta", "kl_coef"]),
        # wrong types
        ("algorithm.beta=abc", ["algorithm.beta", "number", "'abc'"]),
        ("algorithm.beta=true", ["algorithm.beta", "number", "True"]),
        ("train.steps=2.5", ["train.steps", "integer", "2.5"]),
        ("train.steps=true", ["train.steps", "integer", "True"]),
        ("train.progress=1", ["train.progress", "true or false"]),
        ("data.prompts=3", ["data.prompts", "string"]),
        ("model.lora_targets=attn", ["model.lora_targets", "list"]),
        # ranges
        ("algorithm.beta=0", ["algorithm.beta", "> 0"]),
        ("algorithm.beta=-0.5", ["algorithm.beta", "> 0", "-0.5"]),
        ("data.group_size=1", ["data.group_size", ">= 2"]),
        ("algorithm.timestep_fraction=0", ["algorithm.timestep_fraction", "> 0"]),
        ("algorithm.timestep_fraction=1.5", ["algorithm.timestep_fraction", "<= 1", "1.5"]),
        ("algorithm.kl_coef=-0.001", ["algorithm.kl_coef", ">= 0"]),
        # choices
        ("algorithm.adv_mode=signed", ["algorithm.adv_mode", "'signed'", "continuous", "one_only", "binary"]),
        ("sampling.solver=rk4", ["sampling.solver", "'rk4'", "euler", "heun"]),
        ("algorithm.decay_schedule=ema", ["algorithm.decay_schedule", "copy", "delayed_linear_to_0_999"]),
        ("model.family=sdxl", ["model.family", "tiny_av", "stable_audio"]),
        # reward weights
        ("reward.weights.color_match=-1", ["reward.weights.color_match", "negative", ">= 0"]),
        ("reward.weights.color_match=0", ["reward.weights", "sum to 0"]),
        ("reward.weights.color_match=high", ["reward.weights.color_match", "number"]),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override: str, fragments: list[str]) -> None:
    message = _error([override])
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_timestep_fraction_of_one_is_accepted() -> None:
    assert load_config(None, ["algorithm.timestep_fraction=1.0"]).algorithm.timestep_fraction == 1.0
    assert load_config(None, ["algorithm.timestep_fraction=0.01"]).algorithm.timestep_fraction == 0.01


def test_exponent_notation_without_a_dot_is_a_number(tmp_path: Path) -> None:
    # YAML 1.1 (PyYAML) reads 1e-4 as a string; the recipes' own values (kl_coef 1e-4, lr 3e-4) must load
    # whether written as an override or in a file.
    assert load_config(None, ["algorithm.kl_coef=1e-4"]).algorithm.kl_coef == pytest.approx(1e-4)
    assert load_config(_write(tmp_path, "optim:\n  lr: 3e-4\n")).optim.lr == pytest.approx(3e-4)


def test_bad_values_in_a_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"data\.group_size.*>= 2"):
        load_config(_write(tmp_path, "data:\n  group_size: 1\n"))
    with pytest.raises(ConfigError, match=r"unknown config key 'train\.stpes'"):
        load_config(_write(tmp_path, "train:\n  stpes: 3\n"))
    with pytest.raises(ConfigError, match="algorithm: expected a mapping"):
        load_config(_write(tmp_path, "algorithm: 0.1\n"))
    with pytest.raises(ConfigError, match="reward.weights: at least one"):
        load_config(_write(tmp_path, "reward:\n  weights: {}\n"))


def test_override_into_a_value_that_is_not_a_section() -> None:
    with pytest.raises(ConfigError, match="'algorithm'"):
        load_config(None, ["algorithm=1", "algorithm.beta=0.1"])


def test_config_from_dict_checks_like_load_config() -> None:
    assert config_from_dict({"train": {"steps": 7}}).train.steps == 7
    with pytest.raises(ConfigError, match="train.steps"):
        config_from_dict({"train": {"steps": 0}})


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="does not exist") as info:
        load_config(missing)
    assert str(missing) in str(info.value)


def test_non_utf8_yaml_file(tmp_path: Path) -> None:
    path = _write(tmp_path, b"algorithm:\n  adv_mode: caf\xe9\n")
    with pytest.raises(ConfigError, match="UTF-8") as info:
        load_config(path)
    assert str(path) in str(info.value)


def test_invalid_yaml_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="YAML"):
        load_config(_write(tmp_path, "algorithm: [beta: 0.1\n"))


@pytest.mark.slow
def test_cli_train_rejects_a_bad_value_before_doing_any_work(tmp_path: Path) -> None:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"}
    result = subprocess.run(
        [sys.executable, "-m", "omni_diffusion_rl.cli", "train", "algorithm.beta=0", "train.output_dir=out"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "ConfigError" in result.stderr
    assert "algorithm.beta" in result.stderr
    assert "> 0" in result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []  # no run directory, nothing written


def test_unknown_reward_name_lists_the_registered_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["reward.weights={colour_match: 1.0}"])
    message = str(info.value)
    assert "unknown reward 'colour_match'" in message
    for registered in ("color_match", "pitch_match", "timing_match", "av_sync"):
        assert registered in message


def test_reward_options_reach_the_reward_and_must_name_a_used_reward(tmp_path: Path) -> None:
    from omni_diffusion_rl.reward import WeightedReward

    cfg = load_config(
        None, ["reward.weights={color_match: 1.0}", "reward.options={color_match: {sigma: 0.5}}"]
    )
    combined = WeightedReward.from_registry(cfg.reward.weights, cfg.reward.options)
    assert combined.components["color_match"].sigma == 0.5
    with pytest.raises(ConfigError, match="reward.options.pitch_match"):
        load_config(None, ["reward.weights={color_match: 1.0}", "reward.options={pitch_match: {}}"])
    with pytest.raises(ConfigError, match="reward.options.color_match: expected a mapping"):
        load_config(None, ["reward.options={color_match: 3}"])


RECIPES = sorted((REPO / "recipes" / "configs").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_loads_and_validates(recipe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from omni_diffusion_rl.prompts import clip_format_of, load_prompts

    monkeypatch.chdir(
        REPO
    )  # recipes name their prompt files relative to the checkout, as the README runs them
    cfg = load_config(recipe)
    assert cfg.train.output_dir.startswith("runs/") and cfg.model.family
    if cfg.data.prompts.startswith(("/data/", "runs/")):  # the user's own questions (a tutorial makes
        return  # runs/my_clips/: docs/own-clips.md)
    clip = clip_format_of(cfg.data)
    assert len(load_prompts(cfg.data.prompts, "train", clip)) >= cfg.data.prompts_per_step
    assert load_prompts(cfg.data.eval_prompts, "heldout", clip)


@pytest.mark.parametrize(
    ("key", "value", "bound"),
    [
        ("train.steps", "1000000001", "<= 1000000000"),
        ("train.seed", "100000000000000000000", "<= 4294967295"),
        ("model.lora_rank", "100000000", "<= 512"),
        ("sampling.num_steps", "1000000000", "<= 1000"),
        ("sampling.eval_num_steps", "1001", "<= 1000"),
        ("data.group_size", "1025", "<= 1024"),
        ("data.prompts_per_step", "100000000", "<= 65536"),
        ("data.eval_samples", "1000000000", "<= 1048576"),
        ("data.clip_fps", "1e9", "<= 240.0"),
    ],
)
def test_counts_that_allocate_are_bounded_with_a_sentence(key: str, value: str, bound: str) -> None:
    """The same bounds as a checkpoint's (checkpoint.py imports them): a count past one is refused
    before anything is allocated for it, naming the key and its bound."""
    with pytest.raises(ConfigError, match=f"{key}: .* is out of range; it must be {bound}"):
        load_config(None, [f"{key}={value}"])
    load_config(None, [f"{key}={bound.split()[-1]}"])  # the bound itself is allowed


def test_odrl_sample_steps_are_bounded_on_the_command_line() -> None:
    from omni_diffusion_rl.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["sample", "--steps", "1000000000"])  # "must be at most 1000"
    assert build_parser().parse_args(["sample", "--steps", "1000"]).steps == 1000


def test_train_help_names_every_algorithm_mode_and_registered_family() -> None:
    """`odrl train --help` once said DiffusionNFT and colocated only, and its family list left out the
    answering families."""
    from omni_diffusion_rl.cli import build_parser
    from omni_diffusion_rl.config import ModelConfig
    from omni_diffusion_rl.registry import models

    parser = build_parser()
    train = next(
        action.choices["train"] for action in parser._actions if getattr(action, "choices", None)
    )  # the train subcommand's parser
    description = train.description
    for word in ("DiffusionNFT", "Flow-GRPO", "RAFT", "distillation", "GSPO", "separate", "hybrid", "auto"):
        assert word in description, word
    family_doc = ModelConfig.__dataclass_fields__["family"].metadata["doc"]
    missing = [name for name in models.names() if name not in family_doc]
    assert not missing, f"model.family's help leaves out {missing}"
