"""Advantage weighted matching (algorithm.name=awm): its loss against a float64 transcription of
the reference's training step, its timestep strata, the lagged copy's decay, and runs on the loop
(on-policy rollouts, the lagged `old` adapter, the async modes)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from omni_diffusion_rl.algorithms.awm import (
    awm_policy_loss,
    ema_decay,
    matching_error,
    matching_log_likelihood,
    stratified_step_indices,
    velocity_gap,
)
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, last_json_line, step_records, tiny_model_dir

AWM = ["algorithm.name=awm", "algorithm.timestep_fraction=1.0", "algorithm.awm_timesteps=2"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


def reference_step_loss(
    v: torch.Tensor,
    v_ref: torch.Tensor,
    v_ema: torch.Tensor,
    noise: torch.Tensor,
    x0: torch.Tensor,
    t: torch.Tensor,
    advantages: torch.Tensor,
    beta: float,
    ema_beta: float,
    power: float = 0.25,
    clip_range: float = 1.0,
) -> torch.Tensor:
    """train_sd3_awm.py's loss for one batch, written out: v, v_ref, v_ema, noise [T, B, ...] at T
    timesteps t [T, B]; 'ghuber' weighting, 'exp_first' loss, 'Uniform' KL weights, advantages
    clipped to 5 and divided by 5, old log-probabilities from the same (on-policy) pass."""
    error = ((v - (noise - x0.unsqueeze(0))) ** 2).flatten(2).mean(dim=2)  # [T, B]
    log_prob = (
        -(torch.pow(error + 1e-10, power) - torch.pow(torch.tensor(1e-10, dtype=v.dtype), power)) * t / power
    )
    old = log_prob.detach()
    a = (advantages.clamp(-5, 5) / 5 * 1.0).unsqueeze(0).repeat(len(t), 1).view(-1)
    ratio = torch.exp(log_prob.view(-1) - old.view(-1))
    unclipped, clipped = -a * ratio, -a * torch.clamp(ratio, 1 - clip_range, 1 + clip_range)
    policy = torch.mean(torch.maximum(unclipped, clipped))
    kl = ((v - v_ref) ** 2).flatten(2).mean(dim=2).mean(dim=0).mean()
    ema_kl = ((v - v_ema) ** 2).flatten(2).mean(dim=2).mean(dim=0).mean()
    return policy + beta * kl + ema_beta * ema_kl


def test_the_loss_and_its_gradient_equal_the_references_in_float64() -> None:
    gen = torch.Generator().manual_seed(0)
    steps, batch, shape = 3, 4, (2, 3, 5)
    v = torch.randn(steps, batch, *shape, generator=gen, dtype=torch.float64)
    v_ref, v_ema = v + 0.1 * torch.randn_like(v), v + 0.05 * torch.randn_like(v)
    noise = torch.randn(steps, batch, *shape, generator=gen, dtype=torch.float64)
    x0 = torch.randn(batch, *shape, generator=gen, dtype=torch.float64)
    t = torch.tensor([[0.9] * batch, [0.6] * batch, [0.3] * batch], dtype=torch.float64)
    advantages = torch.tensor([7.0, -1.5, 0.2, -9.0], dtype=torch.float64)
    grads = {}
    for who in ("reference", "ours"):
        leaf = v.clone().requires_grad_(True)
        if who == "reference":
            loss = reference_step_loss(leaf, v_ref, v_ema, noise, x0, t, advantages, 0.003, 1.0)
        else:  # one pass per timestep, averaged (the loop's passes)
            total = torch.zeros((), dtype=torch.float64)
            for j in range(steps):
                ll = matching_log_likelihood(matching_error(leaf[j], noise[j], x0), t[j])
                total = total + awm_policy_loss(ll, advantages, 5.0)
                total = (
                    total
                    + 0.003 * velocity_gap(leaf[j], v_ref[j]).mean()
                    + velocity_gap(leaf[j], v_ema[j]).mean()
                )
            loss = total / steps
        loss.backward()
        grads[who] = (loss.detach(), leaf.grad)
    torch.testing.assert_close(grads["ours"][0], grads["reference"][0], rtol=0, atol=1e-12)
    torch.testing.assert_close(grads["ours"][1], grads["reference"][1], rtol=0, atol=1e-12)
    # the check can fail: the plain error (uniform weighting) has another gradient
    leaf = v[0].clone().requires_grad_(True)
    awm_policy_loss(
        matching_log_likelihood(matching_error(leaf, noise[0], x0), t[0], "uniform"), advantages, 5.0
    ).backward()
    assert (leaf.grad - grads["reference"][1][0] * steps).abs().max() > 1e-3


def test_a_positive_advantage_lowers_the_samples_matching_error() -> None:
    x0, noise = torch.zeros(1, 4), torch.ones(1, 4)  # target velocity: 1 everywhere
    v = torch.full((1, 4), 0.5, requires_grad=True)
    for sign in (1.0, -1.0):
        v.grad = None
        awm_policy_loss(
            matching_log_likelihood(matching_error(v, noise, x0), torch.tensor([0.5])),
            torch.tensor([sign]),
            5.0,
        ).backward()
        step = -v.grad  # a gradient step's direction
        assert bool((torch.sign(step) == sign).all())  # towards the target for A > 0, away for A < 0


def test_the_timesteps_are_drawn_one_in_each_stratum_of_the_references_grid() -> None:
    """14 steps, timestep_fraction 0.9, 6 timesteps (the reference's GenEval setting)."""
    seen: list[set[int]] = [set() for _ in range(6)]
    for seed in range(200):
        index = stratified_step_indices(14, 0.9, 6, torch.Generator().manual_seed(seed))
        for j, i in enumerate(index.tolist()):
            seen[j].add(i)
    assert seen == [{1}, {2, 3}, {4, 5}, {6, 7}, {8, 9}, {10, 11}]
    first = stratified_step_indices(14, 0.9, 6, torch.Generator().manual_seed(0), skip_first=False)
    assert first[0] in (0, 1)  # 'discrete' starts at the noisiest step
    with pytest.raises(ValueError, match="grid indices 1..1"):
        stratified_step_indices(3, 0.6, 2, torch.Generator())


def test_the_lagged_copy_decays_linearly_to_its_cap() -> None:
    assert [ema_decay(s, 0.3, 0.001) for s in (1, 150, 300, 1000)] == pytest.approx([0.001, 0.15, 0.3, 0.3])


def test_awm_trains_on_policy_and_its_old_adapter_lags(model_dir: Path, tmp_path: Path) -> None:
    overrides = [
        *fast_overrides(model_dir, tmp_path / "run", 3),
        *AWM,
        "algorithm.awm_ema_decay_per_step=0.2",
        "algorithm.awm_ema_decay_max=0.3",
    ]
    trainer = Trainer(load_config(None, overrides))
    transformer = trainer.learner.transformer
    assert (
        trainer.algorithm.rollout_state(transformer).keys()
        == lora.adapter_state_dict(transformer, lora.TRAINED).keys()
    )
    trainer.fit()
    rows = step_records(tmp_path / "run")
    assert [r["old_decay"] for r in rows] == pytest.approx([0.2, 0.3, 0.3])
    assert all(math.isfinite(r["loss/total"]) and r["loss/ema_kl"] >= 0 for r in rows)
    assert rows[0]["loss/ema_kl"] == 0.0 and rows[-1]["loss/ema_kl"] > 0  # the copy starts equal, then lags
    trained = lora.adapter_state_dict(transformer, lora.TRAINED)
    old = lora.adapter_state_dict(transformer, lora.OLD)
    gap = max(
        float((trained[k] - old[k.replace(f".{lora.TRAINED}.", f".{lora.OLD}.")]).abs().max())
        for k in trained
    )
    assert gap > 0  # old lags the trained adapter that the rollouts sample with


def test_bad_awm_options_are_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="awm_weighting"):
        load_config(None, ["algorithm.name=awm", "algorithm.awm_weighting=cubic"])
    with pytest.raises((ConfigError, ValueError), match="grid indices 1..1"):
        load_config(None, ["algorithm.name=awm", "sampling.num_steps=3", "algorithm.timestep_fraction=0.6"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["separate", "hybrid"])
def test_awm_runs_in_the_async_modes_with_two_processes(model_dir: Path, tmp_path: Path, mode: str) -> None:
    from .test_separate import _launch

    run = tmp_path / "run"
    args = [*fast_overrides(model_dir, run, 3), *AWM, f"execution.mode={mode}", "execution.data_timeout_s=60"]
    proc = _launch(args, 29651 if mode == "separate" else 29652)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert last_json_line(proc.stdout)["execution"]["buffer"]["trained"] == 3 * 2 * 2
    assert all(math.isfinite(r["loss/total"]) for r in step_records(run))
