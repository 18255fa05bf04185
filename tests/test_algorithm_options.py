"""Each algorithm owns its options, and every algorithm runs the one update skeleton (issue 25,
items 1 and 2): old flat configs and checkpoints load with the same values, another algorithm's
option is refused by name, `odrl train --help` lists each algorithm's options under its name, and
a small algorithm written against the skeleton (a loss for one micro-batch) trains."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
import yaml

from omni_diffusion_rl.checkpoint import MANIFEST, resolve_checkpoint
from omni_diffusion_rl.config import (
    ConfigError,
    ExperimentConfig,
    config_from_dict,
    describe,
    foreign_option_defaults,
    load_config,
)
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.registry import algorithms
from omni_diffusion_rl.trainers.skeleton import Algorithm
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import ENV, REPO, fast_overrides, odrl, step_records, tiny_model_dir

pytestmark = pytest.mark.usefixtures("single_thread")

OLD_SECTION: dict[str, Any] = {  # the algorithm section every config and checkpoint held before: all keys
    "name": "nft",
    "timestep_fraction": 0.6,
    "options": {},
    "beta": 1.0,
    "adv_clip_max": 5.0,
    "adv_mode": "continuous",
    "per_group_std": False,
    "kl_coef": 0.5,
    "decay_schedule": "linear_to_0_5",
    "raft_keep": 1,
    "distill_states": "visited",
    "distill_weighting": "uniform",
    "nft_coef": 0.0,
    "clip_eps_low": 0.0003,
    "clip_eps_high": 0.0004,
    "ratio_level": "sequence",
    "max_new_tokens": 16,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "adv_std": "population",
    "rollout_backend": "hf",
    "vllm_gpu_memory": 0.3,
    "vllm_enforce_eager": False,
}
ADDED_SINCE: dict[str, Any] = {  # options added after the flat section, at defaults that change nothing
    "adv_per_reward": False,
    "timestep_choice": "random",
    "distill_focus": 0.0,
    "distill_target": "velocity",
    "distill_completions": 3,
    "distill_contrast_from": 0.8,
    "distill_cond_coef": 0.0,
    "credit": "global",
    "credit_balance": "equal",
    "plugins": [],
    "rollout_sde_noise": 0.0,
}
OWN_CHANGES = {  # per algorithm, a non-default value of its own options, as an old run may have set them
    "nft": {"beta": 0.1, "kl_coef": 1e-4, "decay_schedule": "copy"},
    "raft": {"raft_keep": 2},
    "distill": {"distill_states": "noised", "nft_coef": 0.5, "beta": 0.3},
    "gspo": {"adv_std": "sample", "max_new_tokens": 6, "ratio_level": "token"},
}
ANSWERING = {"model": {"family": "tiny_omni"}, "eval": {"metrics": []}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


# ------------------------------------------------------------------ item 1: options by algorithm


@pytest.mark.parametrize(
    "recipe", sorted((REPO / "recipes" / "configs").glob("*.yaml")), ids=lambda p: p.stem
)
def test_every_recipe_loads_with_its_values(recipe: Path) -> None:
    given = yaml.safe_load(recipe.read_text())["algorithm"]
    section = asdict(load_config(recipe).algorithm)
    assert {k: section[k] for k in given} == given
    if section["name"] in OWN_CHANGES:  # the algorithms that were there when the section was flat
        assert set(section) < set(OLD_SECTION) | set(ADDED_SINCE), "only keys configs could always hold"
        assert all(section[k] == v for k, v in ADDED_SINCE.items() if k in section and k not in given)


@pytest.mark.parametrize("name", sorted(OWN_CHANGES))
def test_an_old_flat_section_loads_with_the_same_values(name: str) -> None:
    """Every algorithm's keys, as the old config wrote them (the others at their defaults), load;
    the section keeps the named algorithm's own, with the given values, and round-trips."""
    old = {**OLD_SECTION, "name": name, **OWN_CHANGES[name]}
    cfg = config_from_dict({"algorithm": old, **(ANSWERING if name == "gspo" else {})})
    section = asdict(cfg.algorithm)
    assert section == {k: {**ADDED_SINCE, **old}[k] for k in section}  # added options at their defaults
    assert set(OWN_CHANGES[name]) <= set(section) and section["name"] == name
    assert config_from_dict(cfg.to_dict()) == cfg


def test_an_old_checkpoint_resumes_and_its_saved_config_loads_with_the_same_values(
    model_dir: Path, tmp_path: Path
) -> None:
    """A RAFT run's checkpoint whose state.json records the old flat section (every algorithm's
    keys) loads into the same config and resumes."""
    run = tmp_path / "run"
    cfg = load_config(None, [*fast_overrides(model_dir, run, 1), "algorithm.name=raft"])
    Trainer(cfg).fit()
    checkpoint = resolve_checkpoint(run / "checkpoints")
    state = json.loads((checkpoint / "state.json").read_text())
    saved_keys = {"name", "timestep_fraction", "options", "plugins", "raft_keep"}
    assert set(state["config"]["algorithm"]) == saved_keys
    state["config"]["algorithm"] = {**OLD_SECTION, "name": "raft"}
    _rewrite(checkpoint, "state.json", json.dumps(state))
    saved = config_from_dict(state["config"])
    assert saved == cfg
    train = {**state["config"]["train"], "output_dir": str(tmp_path / "resumed")}
    resumed = Trainer(config_from_dict({**state["config"], "train": train}))
    resumed.load(checkpoint)
    assert resumed.step == 1 and resumed.cfg.algorithm == cfg.algorithm


def _rewrite(checkpoint: Path, name: str, text: str) -> None:
    """Replace a checkpoint file, its manifest entry updated (as an older version would have written it)."""
    data = text.encode()
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.parametrize(
    ("overrides", "owners"),
    [
        (["algorithm.name=raft", "algorithm.beta=0.1"], "distill and nft"),
        (["algorithm.adv_std=sample"], "gspo"),
        (["algorithm.name=gspo", "algorithm.raft_keep=3"], "raft"),
        (["algorithm.distill_states=noised"], "distill"),
    ],
)
def test_another_algorithms_option_is_refused_by_name(overrides: list[str], owners: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    key = overrides[-1].split("=")[0]
    assert f"{key}=" in str(info.value) and f"is an option of {owners}, not of" in str(info.value)


def test_another_algorithms_option_at_its_default_is_dropped_and_a_bad_value_is_named() -> None:
    cfg = load_config(None, ["algorithm.name=raft", "algorithm.beta=1.0", "algorithm.max_new_tokens=16"])
    assert "beta" not in cfg.to_dict()["algorithm"] and not hasattr(cfg.algorithm, "max_new_tokens")
    with pytest.raises(ConfigError, match="algorithm.beta: expected a number, got str 'x'"):
        load_config(None, ["algorithm.name=raft", "algorithm.beta=x"])  # checked as nft checks it
    with pytest.raises(ConfigError, match="nft reads its own keys of the section"):
        load_config(None, ["algorithm.options={beta: 0.1}"])


@pytest.mark.slow
def test_train_help_lists_each_algorithms_options_under_its_name() -> None:
    out = subprocess.run(
        odrl("train", "--help"), capture_output=True, text=True, env=ENV, timeout=300, check=True
    )
    blocks = _help_blocks(out.stdout)
    assert set(blocks) == {"awm", "distill", "flow_grpo", "gspo", "nft", "raft"}
    assert {"beta", "kl_coef", "decay_schedule"} <= blocks["nft"] and "raft_keep" not in blocks["nft"]
    assert blocks["raft"] == {"raft_keep"}
    assert {"adv_std", "max_new_tokens", "rollout_backend"} <= blocks["gspo"]
    assert blocks["distill"] == {
        "distill_states",
        "distill_target",
        "distill_completions",
        "distill_contrast_from",
        "distill_weighting",
        "distill_focus",
        "nft_coef",
        "distill_cond_coef",
    }
    assert "algorithm.name=distill (distillation) reads nft's options and:" in out.stdout


def _help_blocks(text: str) -> dict[str, set[str]]:
    """algorithm name -> the option keys listed under it in the help's `algorithm.name=NAME ...:` block."""
    blocks: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("  algorithm.name=") and line.endswith(":"):
            current = blocks.setdefault(line.split("=")[1].split()[0], set())
        elif current is not None and line.startswith("    algorithm."):
            current.add(line.split()[0].removeprefix("algorithm."))
        else:
            current = None
    return blocks


# ------------------------------------------------------------------ item 2: one update skeleton


EXAMPLE = REPO / "examples" / "advantage_weighted_fm.py"  # docs/adding-an-algorithm.md's plug-in


@pytest.fixture
def awfm(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The tutorial's plug-in file, imported as reward.plugins imports it, its algorithm registered
    for this test only."""
    algorithms.names()  # the entry points, loaded before the registry is copied
    monkeypatch.setattr(algorithms, "_factories", dict(algorithms._factories))  # noqa: SLF001
    spec = importlib.util.spec_from_file_location("awfm_plugin_under_test", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module


def test_the_tutorials_weights_are_exp_advantage_at_mean_one_over_the_trainable(awfm: ModuleType) -> None:
    adv = torch.tensor([2.0, -1.0, 0.0, 10.0, 0.5])
    trainable = torch.tensor([True, True, True, True, False])
    w = awfm.advantage_weights(adv, trainable, temperature=0.5, clip=3.0)
    raw = torch.exp(torch.tensor([2.0, -1.0, 0.0, 3.0]) / 0.5)  # 10 clipped to 3
    assert torch.allclose(w[:4], raw / raw.mean()) and w[4] == 0
    assert torch.isclose(w[trainable].mean(), torch.tensor(1.0))
    flat = awfm.advantage_weights(adv, trainable, temperature=1e6, clip=3.0)
    assert torch.allclose(flat[:4], torch.ones(4), atol=1e-5), "a high temperature weighs all alike"
    assert not awfm.advantage_weights(adv, torch.zeros(5, dtype=torch.bool), 1.0, 3.0).any()


def test_the_tutorials_plugin_algorithm_trains_on_the_skeleton_and_declares_its_options(
    model_dir: Path, tmp_path: Path, awfm: ModuleType
) -> None:
    run = tmp_path / "run"
    overrides = [*fast_overrides(model_dir, run, 2), "algorithm.name=awfm", "algorithm.awfm_temperature=0.5"]
    cfg = load_config(None, [*overrides, "train.eval_at_start_and_end=false"])
    assert cfg.algorithm.awfm_temperature == 0.5 and cfg.algorithm.awfm_clip == 3.0
    with pytest.raises(ConfigError, match="is an option of awfm, not of nft"):
        load_config(None, ["algorithm.awfm_temperature=0.5"])
    assert any(line.startswith("  algorithm.awfm_temperature (float, default 1.0)") for line in describe())
    trainer = Trainer(cfg)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    trainer.fit()
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["loss/total"] > 0 and r["grad_norm"] > 0 and r["awfm/weight_max"] >= 1 for r in rows)
    trained = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    old = lora.adapter_state_dict(trainer.transformer, lora.OLD)
    assert any(not torch.equal(before[k], trained[k]) for k in trained), "the trained adapter moved"
    assert all(
        torch.equal(v, old[k.replace(f".{lora.TRAINED}.", f".{lora.OLD}.")]) for k, v in trained.items()
    ), "on-policy: the rollout adapter follows the trained one"


def test_default_sections_are_one_class_per_algorithm() -> None:
    """Sections compare equal across loads (one joined class per options dataclass)."""
    raft = ["algorithm.name=raft"]
    assert load_config() == ExperimentConfig() and load_config(None, raft) == load_config(None, raft)


# ------------------------------------------------------------------ review findings


@pytest.mark.parametrize("name", sorted(OWN_CHANGES))
def test_a_config_pickles_and_comes_back_equal(name: str) -> None:
    """The sections' classes are made at run time; a config still pickles (rebuilt by name)."""
    cfg = config_from_dict(
        {"algorithm": {"name": name, **OWN_CHANGES[name]}, **(ANSWERING if name == "gspo" else {})}
    )
    assert pickle.loads(pickle.dumps(cfg)) == cfg


def test_another_algorithms_option_is_refused_by_name_not_by_its_owners_checks() -> None:
    with pytest.raises(ConfigError, match="raft_keep=100 is an option of raft, not of nft"):
        load_config(None, ["algorithm.raft_keep=100"])


@dataclass(frozen=True)
class FrozenOptions:
    frozen_x: float = 1.0


@dataclass
class RequiredOptions:
    required_x: float


class NotADataclass:
    plain_x = 1.0


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (FrozenOptions, "must not be frozen"),
        (RequiredOptions, "required_x have no default"),
        (NotADataclass, "must be a dataclass"),
    ],
)
def test_a_malformed_plugin_options_class_is_named_and_breaks_nothing_else(
    options: type, says: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    algorithms.names()
    monkeypatch.setattr(algorithms, "_factories", dict(algorithms._factories))  # noqa: SLF001
    algorithms.register("malformed")(type("Malformed", (Algorithm,), {"options_type": options}))
    with pytest.raises(ConfigError, match=says):
        load_config(None, ["algorithm.name=malformed"])
    assert load_config(None, ["algorithm.name=raft", "algorithm.beta=1.0"]).algorithm.name == "raft"
    assert any(line.startswith("algorithm.name=malformed: cannot be loaded") for line in describe())


@pytest.mark.parametrize(
    "recipe", sorted((REPO / "recipes" / "configs").glob("*_nft.yaml")), ids=lambda p: p.stem
)
def test_a_recipe_runs_another_algorithm_once_its_own_options_are_reset(recipe: Path) -> None:
    """What `odrl bench learning --modes colocated,raft:colocated` does with an NFT recipe."""
    cfg = load_config(recipe)
    resets = foreign_option_defaults(cfg.algorithm, "raft")
    overrides = ["algorithm.name=raft", *(f"algorithm.{k}={json.dumps(v)}" for k, v in resets.items())]
    assert load_config(recipe, overrides).algorithm.name == "raft"
    if cfg.algorithm.beta != 1.0:
        with pytest.raises(ConfigError, match="is an option of distill and nft, not of raft"):
            load_config(recipe, ["algorithm.name=raft"])


def test_nft_rollouts_sample_the_sde_when_asked_and_train_on_its_x0(model_dir: Path, tmp_path: Path) -> None:
    """algorithm.rollout_sde_noise > 0: the rollouts step with Flow-GRPO's SDE (other samples than the
    ODE's from the same noise), NFT trains on them, and a solver with no SDE form is refused."""
    from omni_diffusion_rl.trainers.nft import DiffusionNFT
    from omni_diffusion_rl.trainers.trainer import Trainer

    assert DiffusionNFT.sde_sampling(load_config(None, [])) is None
    sampling = DiffusionNFT.sde_sampling(load_config(None, ["algorithm.rollout_sde_noise=0.7"]))
    assert sampling is not None and sampling.noise_level == 0.7 and sampling.window_size == 0
    with pytest.raises(ConfigError, match="rollout_sde_noise=0.7 samples rollouts with an SDE"):
        load_config(None, ["algorithm.rollout_sde_noise=0.7", "sampling.solver=heun"])
    with pytest.raises(ConfigError, match="rollout_sde_noise=0.7: distillation's teacher targets"):
        load_config(
            REPO / "recipes" / "configs" / "tiny_t2av_distill.yaml", ["algorithm.rollout_sde_noise=0.7"]
        )
    x0 = {}
    for noise in (0.0, 0.7):
        run = tmp_path / f"sde_{noise}"
        overrides = [*fast_overrides(model_dir, run, 1), f"algorithm.rollout_sde_noise={noise}"]
        trainer = Trainer(load_config(None, [*overrides, "train.eval_at_start_and_end=false"]))
        rollout, _ = trainer.experience.make_step(0, *trainer.prompts_for_step(0))
        x0[noise] = rollout.x0
        assert trainer.train_step()["samples/trained"] == 4
    assert not torch.allclose(x0[0.0], x0[0.7])  # the same start noise, another sampler
