"""Flow-GRPO and MixGRPO: the SDE step and the loss against the reference's formulas (float64), the
SDE's marginals, the window, bad options, non-finite log-probabilities, and training on the loop."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml

from omni_diffusion_rl.algorithms.flow_grpo import (
    clipped_policy_loss,
    drawn_window,
    gaussian_step_kl,
    sde_sigma,
    sde_step,
    sde_window,
    step_kl,
)
from omni_diffusion_rl.benchmarks.tiny_families import H3_CLIP, LTX2_CLIP, save_tiny_h3, save_tiny_ltx2
from omni_diffusion_rl.config import ConfigError, load_config
from omni_diffusion_rl.experience.rollout import BEHAVIOUR_LOGP, SDE_STEPS, STATES, SDESampling
from omni_diffusion_rl.experience.sampling import flow_match_time_grid, sample_sde
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.models.policy import repeat_condition
from omni_diffusion_rl.registry import rewards
from omni_diffusion_rl.trainers.flow_grpo import FlowGRPO, trained_sde_steps
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import fast_overrides, last_json_line, step_records, tiny_model_dir, tiny_sd3

pytestmark = pytest.mark.usefixtures("single_thread")
PROMPTS = ["a red circle with a low tone at the start", "a blue square with a high tone at the end"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir(tmp_path_factory.mktemp("model"))


# ---------------------------------------------------------------------------------------------
# The reference's formulas (yifan123/flow_grpo: sde_step_with_logprob and train_sd3.py's loss),
# written out here as the oracle, in its own algebraic form: sigma_max is the grid's second time,
# dt = sigma_prev - sigma < 0, the log-density averaged over every entry but the batch's.


def reference_step(v, x, sigmas, index, noise_level, prev_sample=None, z=None, drift_sign=1.0):
    sigma = sigmas[index].view(-1, 1, 1, 1)
    sigma_prev = sigmas[index + 1].view(-1, 1, 1, 1)
    sigma_max = sigmas[1].item()
    dt = sigma_prev - sigma
    std_dev_t = torch.sqrt(sigma / (1 - torch.where(sigma == 1, sigma_max, sigma))) * noise_level
    mean = (
        x * (1 + drift_sign * std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    if prev_sample is None:
        prev_sample = mean + std_dev_t * torch.sqrt(-1 * dt) * z
    log_prob = (
        -((prev_sample - mean) ** 2) / (2 * ((std_dev_t * torch.sqrt(-1 * dt)) ** 2))
        - torch.log(std_dev_t * torch.sqrt(-1 * dt))
        - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=x.dtype)))
    )
    return prev_sample, log_prob.mean(dim=(1, 2, 3)), mean, std_dev_t


def reference_loss(
    log_prob, old_log_prob, advantages, clip_range, adv_clip_max, mean, mean_ref, std_dev_t, beta
):
    advantages = torch.clamp(advantages, -adv_clip_max, adv_clip_max)
    ratio = torch.exp(log_prob - old_log_prob)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.mean(torch.maximum(unclipped, clipped))
    kl = ((mean - mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    return policy_loss + beta * torch.mean(kl)


def _case(seed: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, 3, 5, 6)
    return (torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(3))  # type: ignore[return-value]


@pytest.mark.parametrize(
    "index", [0, 1, 4, 8]
)  # 0: t = 1, where sigma's denominator takes the grid's second time
def test_the_sde_step_equals_the_reference_in_float64(index: int) -> None:
    sigmas = flow_match_time_grid(10, 3.0).double()
    v, x, z = _case(index)
    t, t_next = sigmas[index].expand(len(x)), sigmas[index + 1].expand(len(x))
    ref_next, ref_logp, ref_mean, ref_std = reference_step(v, x, sigmas, torch.full((4,), index), 0.7, z=z)
    x_next, logp, mean, std = sde_step(v, x, t, t_next, 0.7, float(sigmas[1]), noise=z)
    dt = float(sigmas[index + 1] - sigmas[index])
    for ours, theirs in [
        (x_next, ref_next),
        (logp, ref_logp),
        (mean, ref_mean),
        (std, ref_std * math.sqrt(-dt)),
    ]:
        torch.testing.assert_close(ours, theirs.expand_as(ours), rtol=0, atol=1e-10)
    scored = sde_step(v, x, t, t_next, 0.7, float(sigmas[1]), x_next=x_next)  # scoring a recorded step
    torch.testing.assert_close(scored[1], ref_logp, rtol=0, atol=1e-10)
    # the check can fail: the drift correction with its sign flipped is far from ours
    _, _, flipped, _ = reference_step(v, x, sigmas, torch.full((4,), index), 0.7, z=z, drift_sign=-1.0)
    assert (flipped - mean).abs().max() > 1e-4


def test_the_loss_equals_the_reference_in_float64() -> None:
    sigmas = flow_match_time_grid(10, 3.0).double()
    v, x, z = _case(7)
    v_ref = v + 0.05 * torch.randn_like(v)
    index = torch.full((4,), 3)
    x_next, old_logp, _, _ = reference_step(v + 0.01, x, sigmas, index, 0.7, z=z)  # behaviour: other weights
    _, ref_logp, ref_mean, std_dev_t = reference_step(v, x, sigmas, index, 0.7, prev_sample=x_next)
    _, _, ref_mean_ref, _ = reference_step(v_ref, x, sigmas, index, 0.7, prev_sample=x_next)
    advantages = torch.tensor([2.0, -7.0, 0.5, -0.1], dtype=torch.float64)
    for clip_range in (1e-4, 0.2, 10.0):
        expected = reference_loss(
            ref_logp, old_logp, advantages, clip_range, 5.0, ref_mean, ref_mean_ref, std_dev_t, 0.04
        )
        t, t_next = sigmas[3].expand(4), sigmas[4].expand(4)
        _, logp, mean, step_std = sde_step(v, x, t, t_next, 0.7, float(sigmas[1]), x_next=x_next)
        _, _, mean_ref, _ = sde_step(v_ref, x, t, t_next, 0.7, float(sigmas[1]), x_next=x_next)
        policy, _ = clipped_policy_loss(logp, old_logp, advantages, clip_range, 5.0)
        kl = step_kl(mean, mean_ref, t, 0.7, float(sigmas[1]))  # what FlowGRPO adds, times kl_coef
        torch.testing.assert_close(policy + 0.04 * kl.mean(), expected, rtol=0, atol=1e-10)
    # kl_coef is in the reference's units: the Gaussian steps' own KL is 1/|dt| times larger
    closed_form = gaussian_step_kl(mean, mean_ref, step_std)
    torch.testing.assert_close(closed_form, kl / float(sigmas[3] - sigmas[4]), rtol=1e-9, atol=0)
    assert float(sigmas[3] - sigmas[4]) < 0.5  # so the two units differ (by more than 2x)


def test_the_sde_keeps_the_odes_marginals() -> None:
    """Data x0 ~ N(0, s^2) has the exact velocity v(x, t) = (t - (1 - t) s^2) x / var_t with
    var_t = (1 - t)^2 s^2 + t^2; sampling it with the SDE ends at std s (a flipped drift correction
    or a wrong noise scale would not)."""
    s, steps, n = 0.5, 200, 20000
    grid = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64).float()

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        tb = t.view(-1, 1)
        return (tb - (1 - tb) * s**2) * x / ((1 - tb) ** 2 * s**2 + tb**2)

    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(n, 1, generator=gen)
    sde_steps = torch.ones(steps, dtype=torch.bool)
    sde_steps[-1] = False
    step_noise = torch.randn(n, steps - 1, 1, generator=gen)
    x0, states, log_probs = sample_sde(velocity, noise, grid, 0.7, sde_steps, step_noise)
    assert abs(float(x0.std()) - s) < 0.02
    middle = states[:, steps // 2]  # t = 0.5: std sqrt(0.25 s^2 + 0.25)
    assert abs(float(middle.std()) - math.sqrt(0.25 * s**2 + 0.25)) < 0.02
    assert states.shape == (n, steps, 1) and bool(torch.isfinite(log_probs).all())
    assert bool((log_probs[:, -1] == 0).all())  # the deterministic last step has no log-probability


def test_sde_sampling_keeps_every_tensor_on_the_latents_device() -> None:
    """The grid is made on the CPU; a latent elsewhere (meta stands in for CUDA here) must not meet
    a CPU tensor in a step."""
    grid = flow_match_time_grid(4, 3.0)
    noise = torch.empty(2, 3, 4, device="meta")
    steps = torch.tensor([True, True, False, False])
    x0, states, log_probs = sample_sde(lambda x, t: x * 0.5, noise, grid, 0.7, steps, torch.empty(2, 2, 3, 4))
    assert x0.device.type == states.device.type == log_probs.device.type == "meta"
    t = grid[:1].expand(2)
    _, logp, _, _ = sde_step(noise, noise, t, grid[1:2].expand(2), 0.7, float(grid[1]), x_next=noise)
    assert logp.device.type == "meta"


def test_sigma_at_t_one_uses_the_grids_second_time() -> None:
    t = torch.tensor([1.0, 0.5], dtype=torch.float64)
    torch.testing.assert_close(
        sde_sigma(t, 0.7, 0.9), torch.tensor([0.7 * math.sqrt(10.0), 0.7], dtype=torch.float64)
    )


class MixGRPOStates:
    """MixGRPO's window state as its training loop steps it (GRPOTrainingStates, progressive with
    roll_back and prog_overlap): read the window, then update once per iteration."""

    def __init__(self, max_timesteps: int, group_size: int, iters_per_group: int, overlap_step: int) -> None:
        self.max, self.size, self.every, self.step = max_timesteps, group_size, iters_per_group, overlap_step
        self.cur, self.iter_in_group = 0, 0

    def window(self) -> list[int]:
        return list(range(self.cur, min(self.cur + self.size, self.max)))

    def update(self) -> None:
        self.iter_in_group += 1
        if self.iter_in_group >= self.every:
            self.iter_in_group = 0
            self.cur += self.step
        if self.cur > self.max:
            self.cur, self.iter_in_group = 0, 0


@pytest.mark.parametrize(("end", "size", "every", "stride"), [(23, 4, 25, 1), (8, 3, 20, 1), (9, 3, 5, 2)])
def test_the_window_follows_mixgrpos_schedule_over_700_iterations(
    end: int, size: int, every: int, stride: int
) -> None:
    states = MixGRPOStates(end, size, every, stride)
    for k in range(700):
        start, stop = sde_window(k, end, size, stride, every)
        assert list(range(start, stop)) == states.window(), k
        states.update()


def test_the_window_shrinks_at_the_tail_empties_and_rolls_back() -> None:
    """MixGRPO's own script (25 steps, a window of 4 moving 1 step every 25 iterations, roll_back)."""
    assert sde_window(499, 23, 4, 1, 25) == (19, 23)
    assert sde_window(500, 23, 4, 1, 25) == (20, 23)  # shrinks at the tail
    assert sde_window(550, 23, 4, 1, 25) == (22, 23)
    assert sde_window(575, 23, 4, 1, 25) == (23, 23)  # one group of iterations with no window
    assert sde_window(600, 23, 4, 1, 25) == (0, 4)  # then back to the front
    assert sde_window(123, 9, 0, 1, 1) == (0, 9)  # no window: every step before the end
    with pytest.raises(ValueError, match="window of 10 steps is larger than the 9"):
        sde_window(0, 9, 10, 1, 1)
    # the sampler: MixGRPO's window covers steps 0 .. num_steps - 3 (its max_timesteps = steps - 2)
    steps = SDESampling(0.7, window_size=2, window_stride=1, window_every=1).steps(10, 3)
    assert steps.tolist() == [False, False, False, True, True, False, False, False, False, False]
    assert SDESampling(0.7, 2).steps(10, 7).tolist() == [False] * 7 + [True, False, False]
    assert not SDESampling(0.7, 2).steps(10, 8).any()


def test_a_drawn_window_starts_anywhere_in_its_range_keyed_by_seed_and_step() -> None:
    """Flow-GRPO-Fast: a window of 3 drawn in (0, 5) starts at 0, 1 or 2, the same for a (seed, step)."""
    sampling = SDESampling(0.7, window_size=3, window_range=5, seed=4)
    masks = [sampling.steps(10, step) for step in range(60)]
    starts = {int(m.float().argmax()) for m in masks}
    assert starts == {0, 1, 2} and all(int(m.sum()) == 3 for m in masks)
    assert all(bool(m[int(m.float().argmax()) : int(m.float().argmax()) + 3].all()) for m in masks)
    assert torch.equal(masks[7], sampling.steps(10, 7))
    other_seed = SDESampling(0.7, window_size=3, window_range=5, seed=5)
    assert any(not torch.equal(m, other_seed.steps(10, i)) for i, m in enumerate(masks))
    fixed = SDESampling(0.7, window_size=2, window_range=2)  # a fixed early window
    assert all(fixed.steps(10, i).tolist() == [True, True] + [False] * 8 for i in range(5))
    with pytest.raises(ValueError, match="needs 0 < size <= range end"):
        drawn_window(4, 3, torch.Generator())


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["algorithm.sde_noise=0"], "algorithm.sde_noise"),
        (["algorithm.sde_noise=-0.5"], "algorithm.sde_noise"),
        (["algorithm.sde_noise=.nan"], "algorithm.sde_noise"),
        (["algorithm.sde_noise=.inf"], "algorithm.sde_noise: inf is not a finite number"),
        (["algorithm.sde_window_size=9"], "algorithm.sde_window_size=9 is larger than the 8 steps"),
        (
            ["algorithm.sde_window_size=3", "algorithm.sde_window_range=10"],
            "algorithm.sde_window_range=10 draws a window of sde_window_size=3 steps: it needs 0 <",
        ),
        (["algorithm.sde_window_range=4"], "draws a window of sde_window_size=0 steps"),
        (["algorithm.clip_range=0"], "algorithm.clip_range"),
        (["algorithm.clip_range=-1e-4"], "algorithm.clip_range"),
        (["sampling.solver=heun"], "sampling.solver=heun has none; use one that does: euler"),
        (["sampling.num_steps=1", "algorithm.sde_window_size=0"], "flow_grpo needs at least 2 steps"),
        (["algorithm.beta=0.5"], "algorithm.beta"),  # DiffusionNFT's, not Flow-GRPO's
    ],
)
def test_bad_flow_grpo_options_are_refused_by_name(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, ["algorithm.name=flow_grpo", "sampling.num_steps=10", *overrides])


def test_clip_range_must_be_positive_in_the_pure_function_too() -> None:
    with pytest.raises(ValueError, match="clip_range must be > 0"):
        clipped_policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 0.0, 5.0)


def test_flow_grpo_trains_on_the_loop_on_policy(model_dir: Path, tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            *fast_overrides(model_dir, tmp_path / "run", 3),
            "algorithm.name=flow_grpo",
            "algorithm.kl_coef=0.04",
            "eval.every=2",
        ],
    )
    trainer = Trainer(cfg)
    assert isinstance(trainer.algorithm, FlowGRPO)
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    trainer.fit()
    rows = step_records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["grpo/logp_gap"] < 1e-4, "colocated: the trained policy is the one that sampled"
        assert r["grpo/clip_fraction"] == 0.0 and r["loss/kl"] >= 0
        assert math.isfinite(r["loss/total"]) and r["grad_norm"] > 0
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in evals if "eval/reward" in r]  # at the start, every 2 steps, at the end
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert [r["eval/generated_samples"] for r in evals] == [0, 8, 12]
    seconds = [r["eval/train_seconds"] for r in evals]
    assert seconds[0] == 0.0 and 0 < seconds[1] < seconds[2]
    trained = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    assert any(not torch.equal(before[k], trained[k]) for k in trained), "the trained adapter moved"
    old = lora.adapter_state_dict(trainer.transformer, lora.OLD)
    assert all(
        torch.equal(v, old[k.replace(f".{lora.TRAINED}.", f".{lora.OLD}.")]) for k, v in trained.items()
    )


def test_guidance_is_the_two_velocities_mix_and_off_at_scale_one() -> None:
    from omni_diffusion_rl.algorithms.guidance import guided_velocity

    v_prompt, v_empty = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    assert guided_velocity(v_prompt, v_empty, 1.0) is v_prompt
    torch.testing.assert_close(guided_velocity(v_prompt, v_empty, 4.5), v_empty + 4.5 * (v_prompt - v_empty))


def test_guided_rollouts_record_the_guided_steps_log_probabilities(model_dir: Path) -> None:
    """The behaviour log-probability of a guided SDE rollout is the guided velocity's: recomputed
    with guidance it matches, recomputed without it does not (a loss on the plain velocity would
    train a policy that never sampled)."""
    from omni_diffusion_rl.experience.guidance import encode_empty, guided
    from omni_diffusion_rl.experience.rollout import SDEDraw, generate
    from omni_diffusion_rl.models import build_policy

    cfg = load_config(None, fast_overrides(model_dir, Path("unused"), 1))
    policy, _ = build_policy(cfg.model)
    steps = torch.tensor([True, True, False])
    draw = SDEDraw(
        0.7, steps, torch.randn(4, 2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    )
    noise = torch.randn(4, *policy.latent_shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        rollout = generate(
            policy, ["a red circle", "a blue square"], [0, 1], noise, 3, 1.0, "euler", sde=draw, cfg_scale=3.0
        )
        plain = generate(policy, ["a red circle", "a blue square"], [0, 1], noise, 3, 1.0, "euler", sde=draw)
        assert not torch.allclose(rollout.x0, plain.x0, atol=1e-3), "guidance changes the samples"
        grid, states = rollout.grid, rollout.extras[STATES]
        t, t_next, cap = grid[1].expand(4), grid[2].expand(4), float(grid[1])
        empty = repeat_condition(encode_empty(policy, "cpu"), 4)
        gaps = {}
        for scale in (3.0, 1.0):
            v = guided(policy, states[:, 1], t, rollout.cond, empty, scale)
            _, logp, _, _ = sde_step(v, states[:, 1], t, t_next, 0.7, cap, x_next=states[:, 2])
            gaps[scale] = float((logp - rollout.extras[BEHAVIOUR_LOGP][:, 1]).abs().max())
    assert gaps[3.0] < 1e-3 < gaps[1.0]


def test_guidance_is_refused_where_it_would_not_be_trained_and_a_guided_checkpoint_evaluates(
    model_dir: Path, tmp_path: Path
) -> None:
    from omni_diffusion_rl.cli.generate import sample_guidance
    from omni_diffusion_rl.evaluation.targets import target_config

    with pytest.raises(
        ConfigError, match="sampling.cfg_scale=2: algorithm.name=nft trains the unguided velocity"
    ):
        Trainer(load_config(None, [*fast_overrides(model_dir, tmp_path / "nft", 1), "sampling.cfg_scale=2"]))
    with pytest.raises(ConfigError, match="sampling.cfg_scale"):
        load_config(None, ["algorithm.name=flow_grpo", "sampling.cfg_scale=0.5"])
    run = tmp_path / "guided"
    overrides = [*fast_overrides(model_dir, run, 1), "algorithm.name=flow_grpo", "sampling.cfg_scale=2"]
    Trainer(load_config(None, [*overrides, "train.eval_at_start_and_end=false"])).fit()
    # odrl eval reads the run's sampling section (guided) and evaluates it as it was trained
    assert target_config(str(run / "checkpoints"), None, []).sampling.cfg_scale == 2.0
    assert sample_guidance(str(run / "checkpoints"), None) == 2.0  # odrl sample samples as the run did
    assert sample_guidance(str(run / "checkpoints"), 1.0) == 1.0 and sample_guidance(None, None) == 1.0


def _adam_steps_and_records(model_dir: Path, run_dir: Path, extra: list[str]) -> tuple[set[int], list[dict]]:
    """A 2-step flow_grpo run: the optimizer steps its parameters took, and its step records."""
    trainer = Trainer(
        load_config(None, [*fast_overrides(model_dir, run_dir, 2), "algorithm.name=flow_grpo", *extra])
    )
    trainer.fit()
    return {int(state["step"]) for state in trainer.learner.optimizer.state.values()}, step_records(run_dir)


def test_several_updates_per_batch_step_the_optimizer_on_each_share(model_dir: Path, tmp_path: Path) -> None:
    """updates_per_batch=2: two optimizer steps per step of experience, each on half of the prompt
    groups; the second is off-policy by the first's change, so the logged gap is above 0."""
    runs = {
        updates: _adam_steps_and_records(
            model_dir,
            tmp_path / f"run{updates}",
            ["train.eval_at_start_and_end=false", f"algorithm.updates_per_batch={updates}"],
        )
        for updates in (1, 2)
    }
    assert runs[1][0] == {2} and runs[2][0] == {4}
    assert all(r["grpo/logp_gap"] < 1e-4 for r in runs[1][1])
    assert all(r["grpo/logp_gap"] > 1e-6 and math.isfinite(r["loss/total"]) for r in runs[2][1])
    with pytest.raises(ConfigError, match="algorithm.updates_per_batch=3 splits data.prompts_per_step=2"):
        load_config(
            None,
            [
                *fast_overrides(model_dir, tmp_path / "run3"),
                "algorithm.name=flow_grpo",
                "algorithm.updates_per_batch=3",
            ],
        )


def test_a_window_trains_only_its_steps_and_records_them(model_dir: Path, tmp_path: Path) -> None:
    overrides = [
        *fast_overrides(model_dir, tmp_path / "run", 1),
        "algorithm.name=flow_grpo",
        "sampling.num_steps=6",
        "algorithm.sde_window_size=2",
        "algorithm.sde_window_every=1",
        "algorithm.timestep_fraction=1.0",
    ]
    trainer = Trainer(load_config(None, overrides))
    experience = trainer.experience
    # MixGRPO's window covers steps 0-3 of 6: places 0, 1, 2, then 3 alone, then none, then 0 again
    for step, window in [(0, [0, 1]), (1, [1, 2]), (3, [3]), (4, []), (5, [0, 1])]:
        rollout, scored = experience.make_step(step, PROMPTS, [0, 1])
        sde = rollout.extras[SDE_STEPS]
        assert sde.sum(dim=1).tolist() == [float(len(window))] * 4
        assert sde[0].nonzero().flatten().tolist() == window
        logp = rollout.extras[BEHAVIOUR_LOGP]
        assert bool((logp[sde == 0] == 0).all()) and bool((logp[sde > 0] != 0).all())
        assert rollout.extras[STATES].shape[:2] == (4, 6) and not scored.failures
        trained = trained_sde_steps(rollout, 0, step, 1.0)
        assert sorted(trained[0].tolist()) == window  # only the window's steps are trained


def test_zero_advantages_are_dropped_and_an_update_with_nothing_left_makes_no_step(
    model_dir: Path, tmp_path: Path
) -> None:
    """A reward equal on every sample makes every advantage 0: dropped as train_sd3.py drops them,
    nothing is left and the optimizer never steps; kept, the update steps on them."""
    from . import plugin_rewards  # noqa: F401 - registers test_constant

    adam_steps, records = {}, {}
    for drop in (True, False):
        adam_steps[drop], records[drop] = _adam_steps_and_records(
            model_dir,
            tmp_path / f"run_{drop}",
            ["reward.weights={test_constant: 1.0}", f"algorithm.drop_zero_advantage={str(drop).lower()}"],
        )
    assert adam_steps == {True: set(), False: {2}}
    assert [(r["grpo/skipped"], r["grpo/trained_share"]) for r in records[True]] == [(1.0, 0.0)] * 2
    assert all("grpo/skipped" not in r and r["grpo/trained_share"] == 1.0 for r in records[False])


def test_detach_uncond_stops_the_gradient_through_the_unconditional_velocity() -> None:
    """Guided velocity v_u + s (v_c - v_u): detached, its gradient reaches the conditional branch
    only (scaled by s), not the unconditional one (1 - s)."""
    from omni_diffusion_rl.experience.guidance import guided

    class Branches:
        def __init__(self) -> None:
            self.weights = {k: torch.tensor(w, requires_grad=True) for k, w in (("c", 2.0), ("u", 3.0))}

        def velocity(self, x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
            return x * self.weights[cond["which"]]

    x, t = torch.ones(2, 3), torch.ones(2)
    for detach, expected_u in ((False, (1 - 4.0) * 6), (True, None)):
        branches = Branches()
        v = guided(branches, x, t, {"which": "c"}, {"which": "u"}, 4.0, detach_uncond=detach)  # type: ignore[arg-type]
        v.sum().backward()
        assert float(branches.weights["c"].grad) == 4.0 * 6
        grad_u = branches.weights["u"].grad
        assert (grad_u is None) if expected_u is None else float(grad_u) == expected_u


def test_samples_with_non_finite_log_probabilities_fail_and_are_not_trained(
    model_dir: Path, tmp_path: Path
) -> None:
    """A sample whose sampler output is NaN is a failed sample with a reason: not trained on, not
    scored 0, and logged in failed_samples.jsonl."""
    cfg = load_config(
        None,
        [*fast_overrides(model_dir, tmp_path / "run", 1), "algorithm.name=flow_grpo", "data.group_size=3"],
    )
    trainer = Trainer(cfg)
    policy = trainer.experience.policy
    velocity = policy.velocity

    def breaks_sample_one(x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:  # a fault, injected
        v = velocity(x, t, cond)
        if len(v) == 6 and float(t[0]) < 0.9:
            v = v.clone()
            v[1] = float("nan")
        return v

    policy.velocity = breaks_sample_one  # type: ignore[method-assign]
    rollout, scored = trainer.experience.make_step(0, PROMPTS, [0, 1])
    assert list(scored.failures) == [1] and "sampler" in scored.failures[1]
    assert math.isnan(float(scored.total[1])) and bool(torch.isfinite(scored.total[[0, 2, 3, 4, 5]]).all())
    trainer.fit()
    assert trainer.sample_counts["dropped/reward_failed"] == 1 and trainer.sample_counts["trained"] == 5
    failed = (tmp_path / "run" / "failed_samples.jsonl").read_text()
    assert "not finite" in failed


# ---------------------------------------------------------------------------------------------
# Every model family, tiny and random-init; the async modes with two processes


@rewards.register("test_media_level", overwrite=True)
class MediaLevel:
    """Mean of the picture and the sound, whichever a family makes: a reward for every family."""

    def score(self, media, prompts):  # noqa: ANN001, ANN202
        parts = [m.flatten(1).mean(dim=1) for m in (media.video, media.audio) if m is not None]
        return torch.stack(parts).mean(dim=0)


def _family_model(family: str, root: Path) -> tuple[Path, dict]:
    """A tiny random-init model of `family` saved under `root`, and its model.options."""
    if family == "sd3":
        tiny_sd3().save_pretrained(root / "transformer")
        return root, {}
    if family == "stable_audio":
        from .test_diffusers_adapter import tiny_stable_audio

        tiny_stable_audio().save_pretrained(root / "transformer")
        return root, {}
    if family == "ltx2":
        return save_tiny_ltx2(root), LTX2_CLIP
    return save_tiny_h3(root), H3_CLIP


@pytest.mark.parametrize(
    "family",
    [
        "sd3",
        pytest.param("stable_audio"),
        pytest.param("ltx2", marks=pytest.mark.slow),
        pytest.param("minimax_h3", marks=pytest.mark.slow),
    ],
)
def test_flow_grpo_trains_every_model_family(family: str, tmp_path: Path) -> None:
    model, options = _family_model(family, tmp_path / "model")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a bright sky at dawn\na dark room at night\n", encoding="utf-8")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"model": {"options": options}}))
    overrides = [
        f"model.family={family}",
        f"model.pretrained={model}",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        f"data.prompts={prompts}",
        f"data.eval_prompts={prompts}",
        "data.prompts_per_step=2",
        "data.group_size=2",
        "sampling.num_steps=3",
        "reward.weights={test_media_level: 1.0}",
        "eval.metrics=[]",
        f"train.output_dir={tmp_path / 'run'}",
        "train.steps=2",
        "train.eval_at_start_and_end=false",
        "train.preview_every=0",
        "train.progress=false",
        "algorithm.name=flow_grpo",
        "algorithm.kl_coef=0.04",
    ]
    if family == "minimax_h3":  # guidance-distilled: it refuses the empty prompt guidance needs
        with pytest.raises(
            ConfigError, match="sampling.cfg_scale=2 needs the empty prompt, which this model"
        ):
            Trainer(load_config(str(path), [*overrides, "sampling.cfg_scale=2.0"]))
    else:  # guidance: the rollouts' and the loss's velocities are both guided
        overrides.append("sampling.cfg_scale=2.0")
    trainer = Trainer(load_config(str(path), overrides))
    before = {k: v.clone() for k, v in lora.adapter_state_dict(trainer.transformer, lora.TRAINED).items()}
    summary = trainer.fit()
    assert summary["samples"]["trained"] == 2 * 2 * 2
    after = lora.adapter_state_dict(trainer.transformer, lora.TRAINED)
    assert any(not torch.equal(before[k], after[k]) for k in after), f"the {family} adapter trained"
    for r in step_records(tmp_path / "run"):
        assert math.isfinite(r["loss/total"]) and r["grpo/logp_gap"] < 1e-3 and r["loss/kl"] >= 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("mode", "credit", "port"),
    [("separate", "global", 29633), ("hybrid", "global", 29634), ("separate", "per_modality", 29636)],
)
def test_flow_grpo_runs_in_the_async_modes_with_two_processes(
    model_dir: Path, tmp_path: Path, mode: str, credit: str, port: int
) -> None:
    """The behaviour log-probabilities (each modality's, per modality) travel with each group through
    the buffer; a group made with older weights is trained against its own (the gap is reported).
    separate syncs the weights after steps 2 and 4 only, so which steps train groups one version old
    is fixed, not timed: 2 and 4."""
    from .test_separate import _launch

    run = tmp_path / "run"
    args = [*fast_overrides(model_dir, run, 4), "algorithm.name=flow_grpo", f"execution.mode={mode}"]
    args.append(f"algorithm.credit={credit}")
    if mode == "separate":  # the rollout holds version 0 for steps 1-2 and version 2 for steps 3-4
        args += ["execution.sync_every=2", "execution.max_staleness=1", "execution.on_stale=wait"]
    proc = _launch([*args, "execution.data_timeout_s=60"], port)
    assert proc.returncode == 0, proc.stderr[-4000:]
    buf = last_json_line(proc.stdout)["execution"]["buffer"]
    assert buf["trained"] == 4 * 2 * 2
    rows = step_records(run)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(math.isfinite(r["grpo/logp_gap"]) and math.isfinite(r["loss/total"]) for r in rows)
    if mode == "separate":  # groups one version old are trained against the weights that made them
        assert buf["staleness_histogram"] == {"0": 8, "1": 8}, buf["staleness_histogram"]
        fresh, stale = ([r["grpo/logp_gap"] for r in rows if r["step"] % 2 == k] for k in (1, 0))
        # a group of the trainer's own version is recomputed with the weights that made it (0 here)
        assert max(fresh) < min(stale), {r["step"]: r["grpo/logp_gap"] for r in rows}


def test_eval_every_also_evaluates_the_last_step_when_start_and_end_are_off(
    model_dir: Path, tmp_path: Path
) -> None:
    overrides = [
        *fast_overrides(model_dir, tmp_path / "run", 4),
        "eval.every=2",
        "train.eval_at_start_and_end=false",
    ]
    Trainer(load_config(None, overrides)).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/reward" in r]
    assert [r["step"] for r in evals] == [2, 4] and 0 < evals[0]["eval/train_seconds"] < evals[1][
        "eval/train_seconds"
    ]
