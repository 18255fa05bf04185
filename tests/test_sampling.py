"""Flow-matching ODE solvers against velocity fields whose exact flow is known in closed form.

Convention: x_t = (1 - t) x0 + t eps, so t = 1 is noise and t = 0 is data, and the probability-flow
velocity is v(x, t) = E[eps - x0 | x_t = x].
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from omni_diffusion_rl.algorithms.nft import flow_matching_loss
from omni_diffusion_rl.experience.rollout import generate
from omni_diffusion_rl.experience.sampling import (
    FLOW_MATCH_UNSUPPORTED_OPTIONS,
    SOLVERS,
    check_flow_match_config,
    flow_match_time_grid,
    policy_time_grid,
    sample_ode,
    shift_time,
    time_grid,
)
from omni_diffusion_rl.models.diffusers_adapter import DiffusersAudioPolicy, DiffusersImagePolicy
from omni_diffusion_rl.models.tiny_av import TinyAVPolicy, TinyAVTransformer

from .helpers import tiny_sd3
from .test_diffusers_adapter import tiny_stable_audio

# ---------------------------------------------------------------------------------------------------------
# Time grid


@pytest.mark.parametrize("num_steps", [1, 4, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0, 0.5])
def test_time_grid_endpoints_and_monotonic(num_steps: int, shift: float) -> None:
    grid = time_grid(num_steps, shift)
    assert grid.shape == (num_steps + 1,)
    assert grid.dtype == torch.float32
    assert grid[0].item() == 1.0
    assert grid[-1].item() == 0.0
    assert bool((grid[1:] < grid[:-1]).all())


def test_time_grid_unshifted_is_uniform() -> None:
    assert time_grid(4).tolist() == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0], abs=1e-7)


@pytest.mark.parametrize("shift", [3.0, 0.5])
def test_time_grid_shift_formula(shift: float) -> None:
    n = 8
    expected = []
    for i in range(n + 1):
        t = 1.0 - i / n
        expected.append(shift * t / (1 + (shift - 1) * t))
    assert time_grid(n, shift).tolist() == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # A shift above 1 spends more of the grid at high noise: the midpoint 0.5 moves to s / (1 + s).
    assert shift_time(torch.tensor(0.5), shift).item() == pytest.approx(shift / (1 + shift), rel=1e-6)


def test_time_grid_rejects_zero_steps() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        time_grid(0)


# ---------------------------------------------------------------------------------------------------------
# The diffusers FlowMatchEulerDiscreteScheduler grid


def scheduler_sigmas(num_steps: int, shift: float, num_train_timesteps: int = 1000) -> torch.Tensor:
    scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=num_train_timesteps, shift=shift)
    scheduler.set_timesteps(num_steps)
    return scheduler.sigmas


@pytest.mark.parametrize("num_steps", [1, 10, 40])
@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_flow_match_grid_equals_the_scheduler_sigmas(num_steps: int, shift: float) -> None:
    grid = flow_match_time_grid(num_steps, shift)
    expected = scheduler_sigmas(num_steps, shift)
    assert grid.dtype == torch.float32 and grid.shape == (num_steps + 1,)
    torch.testing.assert_close(grid, expected, rtol=0, atol=1e-6)
    assert grid[0].item() == 1.0 and grid[-1].item() == 0.0
    assert bool((grid[1:] < grid[:-1]).all())


def test_flow_match_grid_other_train_timesteps() -> None:
    torch.testing.assert_close(
        flow_match_time_grid(7, 2.0, 50), scheduler_sigmas(7, 2.0, 50), rtol=0, atol=1e-6
    )


def test_flow_match_grid_reaches_low_noise() -> None:
    grid, uniform = flow_match_time_grid(10, 3.0), time_grid(10, 3.0)
    assert grid[-2].item() < 0.02
    assert uniform[-2].item() == pytest.approx(0.25)
    # The scheduler shifts its end point twice: sigma_min = shift(1 / 1000) at construction, and
    # set_timesteps shifts linspace(1, sigma_min, N) again.
    twice = shift_time(shift_time(torch.tensor(1e-3, dtype=torch.float64), 3.0), 3.0).item()
    assert grid[-2].item() == pytest.approx(twice, rel=1e-6)


def test_flow_match_grid_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_steps"):
        flow_match_time_grid(0)
    with pytest.raises(ValueError, match="num_train_timesteps"):
        flow_match_time_grid(4, 1.0, 1)


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("use_dynamic_shifting", True),
        ("shift_terminal", 0.1),
        ("use_karras_sigmas", True),
        ("use_exponential_sigmas", True),
        ("use_beta_sigmas", True),
        ("invert_sigmas", True),
    ],
)
def test_unsupported_scheduler_options_raise(option: str, value: object) -> None:
    assert option in FLOW_MATCH_UNSUPPORTED_OPTIONS
    config = {"num_train_timesteps": 1000, "shift": 3.0, option: value}
    with pytest.raises(ValueError, match=option):
        check_flow_match_config(config)
    with pytest.raises(ValueError, match=option):
        DiffusersImagePolicy(tiny_sd3(), scheduler_config=config)
    # the same option switched off is fine; num_train_timesteps is read
    off = None if option == "shift_terminal" else False
    assert check_flow_match_config({"num_train_timesteps": 500, option: off}) == 500


def _recording(policy: object) -> list[torch.Tensor]:
    """Patch policy.velocity to record the times it is called at."""
    seen: list[torch.Tensor] = []
    velocity = policy.velocity

    def record(x: torch.Tensor, t: torch.Tensor, cond: dict) -> torch.Tensor:
        seen.append(t.detach().cpu().clone())
        return velocity(x, t, cond)

    policy.velocity = record
    return seen


@pytest.mark.parametrize("kind", ["image", "audio"])
def test_diffusers_policy_generates_on_the_scheduler_grid(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    policy = (
        DiffusersImagePolicy(tiny_sd3()) if kind == "image" else DiffusersAudioPolicy(tiny_stable_audio())
    )
    seen = _recording(policy)
    noise = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rollout = generate(policy, ["a red cat", "a drum"], [0, 1], noise, 10, 3.0, "euler")
    expected = scheduler_sigmas(10, 3.0)
    torch.testing.assert_close(rollout.grid, expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(torch.stack([t[0] for t in seen]), expected[:-1], rtol=0, atol=1e-6)
    assert torch.equal(policy_time_grid(policy, 10, 3.0), rollout.grid)


def test_tiny_model_keeps_the_uniform_grid() -> None:
    torch.manual_seed(0)
    policy = TinyAVPolicy(TinyAVTransformer(dim=32, depth=1, heads=2, mlp_ratio=2))
    assert not hasattr(policy, "time_grid")
    noise = torch.randn(2, *policy.latent_shape, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        rollout = generate(policy, ["a red cat", "a drum"], [0, 1], noise, 4, 3.0, "euler")
    assert torch.equal(rollout.grid, time_grid(4, 3.0))
    assert torch.equal(policy_time_grid(object(), 4, 3.0), time_grid(4, 3.0))


def test_from_pretrained_reads_the_pipeline_scheduler(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tiny_sd3().save_pretrained(tmp_path / "transformer")
    tiny_stable_audio().save_pretrained(tmp_path / "audio" / "transformer")
    # no scheduler folder: the scheduler's defaults
    assert DiffusersImagePolicy.from_pretrained(tmp_path, vae_subfolder=None).num_train_timesteps == 1000
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=500, shift=3.0).save_pretrained(
        tmp_path / "scheduler"
    )
    policy = DiffusersImagePolicy.from_pretrained(tmp_path, vae_subfolder=None)
    assert policy.num_train_timesteps == 500
    torch.testing.assert_close(policy.time_grid(10, 3.0), scheduler_sigmas(10, 3.0, 500), rtol=0, atol=1e-6)
    with pytest.warns(UserWarning, match="differs from the scheduler config's shift"):
        policy.time_grid(10, 1.0)
    FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True).save_pretrained(
        tmp_path / "scheduler"
    )
    with pytest.raises(ValueError, match="use_dynamic_shifting"):
        DiffusersImagePolicy.from_pretrained(tmp_path, vae_subfolder=None)
    # Stable Audio's pipeline scheduler is another class: its folder is not read
    FlowMatchEulerDiscreteScheduler(num_train_timesteps=500).save_pretrained(tmp_path / "audio" / "scheduler")
    audio = DiffusersAudioPolicy.from_pretrained(tmp_path / "audio", vae_subfolder=None)
    assert audio.num_train_timesteps == 1000 and audio.scheduler_config == {}


# ---------------------------------------------------------------------------------------------------------
# Solvers


def _noise(batch: int = 256, dim: int = 3) -> torch.Tensor:
    return torch.randn(batch, dim, generator=torch.Generator().manual_seed(0), dtype=torch.float64)


@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("num_steps", [1, 3, 10])
def test_point_mass_lands_exactly_on_the_data_point(solver: str, num_steps: int) -> None:
    # Data is a single point c: x_t = (1 - t) c + t eps, so eps = (x - (1 - t) c) / t and
    # v = eps - c = (x - c) / t. The flow is a straight line, which even one Euler step follows.
    c = torch.tensor([0.7, -1.3, 2.0], dtype=torch.float64)
    seen_t: list[float] = []

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        assert t.shape == (x.shape[0],)
        seen_t.extend(t.tolist())
        return (x - c) / t.to(x.dtype).view(-1, 1)

    x0 = sample_ode(velocity, _noise(), time_grid(num_steps, shift=3.0), solver=solver)
    torch.testing.assert_close(x0, c.expand_as(x0), rtol=0, atol=1e-6)
    # The field is singular at t = 0: no solver may evaluate it there.
    assert min(seen_t) > 0


def _gaussian_velocity(mu: torch.Tensor, s: float):  # noqa: ANN202 - returns a velocity closure
    """Exact velocity for data N(mu, s^2 I).

    x_t ~ N((1 - t) mu, sigma_t^2) with sigma_t^2 = (1 - t)^2 s^2 + t^2, and
    Cov(eps - x0, x_t) = t - (1 - t) s^2, so v = -mu + (t - (1 - t) s^2) / sigma_t^2 (x - (1 - t) mu).
    Its flow maps noise z at t = 1 to mu + s z at t = 0.
    """

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        t = t.to(x.dtype).view(-1, 1)
        var = (1 - t) ** 2 * s**2 + t**2
        return -mu + (t - (1 - t) * s**2) / var * (x - (1 - t) * mu)

    return velocity


MU = torch.tensor([2.0, -1.0, 0.5], dtype=torch.float64)
S = 0.5


def _gaussian_error(solver: str, num_steps: int, shift: float = 1.0) -> float:
    noise = _noise()
    x0 = sample_ode(_gaussian_velocity(MU, S), noise, time_grid(num_steps, shift), solver=solver)
    return (x0 - (MU + S * noise)).abs().max().item()


def test_gaussian_velocity_is_the_exact_flow() -> None:
    # The closed-form trajectory x_t = (1 - t) mu + sigma_t z satisfies dx/dt = v(x_t, t).
    z = _noise(8)
    velocity = _gaussian_velocity(MU, S)
    for t in (0.9, 0.5, 0.1):
        h = 1e-6

        def x_at(tt: float) -> torch.Tensor:
            return (1 - tt) * MU + math.sqrt((1 - tt) ** 2 * S**2 + tt**2) * z

        derivative = (x_at(t + h) - x_at(t - h)) / (2 * h)
        torch.testing.assert_close(velocity(x_at(t), torch.full((8,), t)), derivative, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("t", [0.2, 0.5, 0.8])
def test_the_flow_matching_loss_is_least_at_the_exact_gaussian_velocity(t: float) -> None:
    """The rectified-flow loss regresses eps - x0 on x_t: for Gaussian data its minimiser is the
    exact velocity above, where the loss is the conditional variance of eps - x0 given x_t,
    Var(eps - x0) - Cov^2 / Var(x_t) = 1 + s^2 - (t - (1 - t) s^2)^2 / sigma_t^2 per dimension."""
    n = 20000
    gen = torch.Generator().manual_seed(0)
    x0 = MU + S * torch.randn(n, 3, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    x_t = (1 - t) * x0 + t * noise
    exact = _gaussian_velocity(MU, S)(x_t, torch.full((n,), t))
    # a per-dimension affine change of the velocity (0 here): the exact velocity is affine in x_t
    shift, scale = (torch.zeros(3, dtype=torch.float64, requires_grad=True) for _ in range(2))
    loss = flow_matching_loss(exact + shift + scale * x_t, noise, x0)
    loss.backward()
    variance = (1 - t) ** 2 * S**2 + t**2
    residual = 1 + S**2 - (t - (1 - t) * S**2) ** 2 / variance
    # sampling error of a mean of 60000 squares: relative sd sqrt(2 / 60000) = 0.006; measured: at most 0.007
    assert loss.item() == pytest.approx(residual, rel=0.03)
    # the gradient's sampling sd is about 2 sqrt(residual) / (3 sqrt(n)) < 0.005; measured: at most 0.006.
    # A target of x0 - eps would move the minimiser to minus this velocity: gradients of 1 and more.
    for grad in (shift.grad, scale.grad):
        assert grad.abs().max().item() < 0.03, (shift.grad, scale.grad)


def test_heun_beats_euler_on_a_gaussian() -> None:
    euler, heun = _gaussian_error("euler", 10), _gaussian_error("heun", 10)
    assert euler > 0.1  # curved paths: Euler is visibly off with 10 steps
    assert heun < euler / 5
    assert _gaussian_error("heun", 20) < _gaussian_error("euler", 20) / 10


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_both_solvers_converge_on_a_gaussian(shift: float) -> None:
    euler = [_gaussian_error("euler", n, shift) for n in (10, 20, 40, 80)]
    heun = [_gaussian_error("heun", n, shift) for n in (10, 20, 40, 80)]
    # Euler is first order: doubling the steps roughly halves the error.
    for coarse, fine in zip(euler, euler[1:], strict=False):
        assert fine < coarse * 0.7
    # Heun is second order: doubling the steps cuts the error by about four.
    for coarse, fine in zip(heun, heun[1:], strict=False):
        assert fine < coarse * 0.4
    assert heun[-1] < euler[-1] / 10
    assert heun[-1] < 0.01


def test_solver_counts_function_evaluations() -> None:
    calls = {"n": 0}

    def velocity(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        calls["n"] += 1
        return torch.zeros_like(x)

    noise = _noise(2)
    sample_ode(velocity, noise, time_grid(5), solver="euler")
    assert calls["n"] == 5
    calls["n"] = 0
    out = sample_ode(velocity, noise, time_grid(5), solver="heun")
    assert calls["n"] == 9  # two per step, one on the last step into t = 0
    torch.testing.assert_close(out, noise)  # a zero field leaves the noise in place


def test_unknown_solver_raises() -> None:
    with pytest.raises(ValueError, match="euler, heun"):
        sample_ode(lambda x, t: x, _noise(2), time_grid(2), solver="rk4")
