"""Flow-matching ODE solvers on a (shifted) time grid; t = 1 is noise, t = 0 is data.

Two grids exist. `time_grid` is uniform in unshifted time, shift(linspace(1, 0, N + 1)), and is what
the built-in tiny model samples and trains on. `flow_match_time_grid` reproduces the sigmas of
diffusers' FlowMatchEulerDiscreteScheduler, shift(linspace(1, shift(1 / T), N)) followed by 0, which
is what the SD3 pipelines (and the DiffusionNFT reference code) sample with; the diffusers adapters
use it. `policy_time_grid` picks the grid a policy asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SOLVERS = ("euler", "heun")

FLOW_MATCH_UNSUPPORTED_OPTIONS = (
    "use_dynamic_shifting",
    "shift_terminal",
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)
"""FlowMatchEulerDiscreteScheduler config options that change its sigmas; `flow_match_time_grid`
reproduces only the static-shift schedule, so a config that turns any of them on is refused."""


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3-style resolution shift: t' = s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def time_grid(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """The uniform grid: num_steps + 1 decreasing times shift(linspace(1, 0, num_steps + 1)).

    The built-in tiny model samples and trains on it. Its last step jumps from shift(1 / num_steps)
    (0.25 for shift 3 and 10 steps) straight to 0, so training on grid[:-1] never sees smaller t.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    return shift_time(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift).float()


def check_flow_match_config(config: Mapping[str, Any]) -> int:
    """Validate a FlowMatchEulerDiscreteScheduler config (a dict or diffusers FrozenDict).

    Raises ValueError naming the first option that makes the scheduler's sigmas differ from the
    static-shift schedule `flow_match_time_grid` computes (dynamic shifting, a terminal stretch,
    karras / exponential / beta sigmas, inverted sigmas). Returns its `num_train_timesteps`
    (1000 when absent). Its `shift` is not read: the caller passes the shift to use.
    """
    for option in FLOW_MATCH_UNSUPPORTED_OPTIONS:
        if config.get(option):
            raise ValueError(
                f"scheduler config sets {option}={config[option]!r}; only the static-shift"
                " FlowMatchEulerDiscreteScheduler schedule is supported (turn that option off)"
            )
    return int(config.get("num_train_timesteps", 1000))


def flow_match_time_grid(num_steps: int, shift: float = 1.0, num_train_timesteps: int = 1000) -> torch.Tensor:
    """The FlowMatchEulerDiscreteScheduler grid: num_steps + 1 decreasing float32 times ending in 0.

    Equal to `FlowMatchEulerDiscreteScheduler(num_train_timesteps=T, shift=shift)` followed by
    `set_timesteps(num_steps)`, then `.sigmas` (static shift only; see `check_flow_match_config`),
    computed here in float64 torch:

    - at construction the scheduler shifts its training sigmas T/T, ..., 1/T, so sigma_max = 1 and
      sigma_min = shift(1 / T);
    - set_timesteps takes num_steps points linspace(sigma_max, sigma_min) and shifts them again, so
      the last non-zero time is shift(shift(1 / T)) (the end point is shifted twice);
    - a final 0 is appended.

    Diffusers models (SD3 pipelines, the DiffusionNFT reference code) sample with this grid; its last
    non-zero time is small (about 0.009 for shift 3, T = 1000), so training on grid[:-1] covers low
    noise levels too, unlike the uniform `time_grid`.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    if num_train_timesteps < 2:
        raise ValueError(f"num_train_timesteps must be >= 2; got {num_train_timesteps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0; got {shift}")
    train_sigmas = torch.tensor([1.0, 1.0 / num_train_timesteps], dtype=torch.float64)
    sigma_max, sigma_min = shift_time(train_sigmas, shift).tolist()  # the scheduler's __init__
    # set_timesteps: linspace in timestep units (a single step keeps only sigma_max), then shift again
    timesteps = torch.linspace(
        sigma_max * num_train_timesteps, sigma_min * num_train_timesteps, num_steps, dtype=torch.float64
    )
    sigmas = shift_time(timesteps / num_train_timesteps, shift)
    return torch.cat([sigmas, sigmas.new_zeros(1)]).float()


def policy_time_grid(policy: object, num_steps: int, shift: float) -> torch.Tensor:
    """The grid `policy` samples (and trains) on: its own `time_grid(num_steps, shift)` when it has
    one (the diffusers adapters return their scheduler's `flow_match_time_grid`), else the uniform
    `time_grid` (the built-in tiny model)."""
    method = getattr(policy, "time_grid", None)
    grid = method(num_steps, shift) if callable(method) else time_grid(num_steps, shift)
    if grid.shape != (num_steps + 1,):
        raise ValueError(
            f"{type(policy).__name__}.time_grid gave shape {tuple(grid.shape)}; expected ({num_steps + 1},)"
        )
    return grid


@torch.no_grad()
def sample_ode(
    velocity: VelocityFn,
    noise: torch.Tensor,
    grid: torch.Tensor,
    solver: str = "euler",
    states: list[torch.Tensor] | None = None,
) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = grid[0] (noise) to grid[-1]; returns the final x (x0).
    `states`, when given, receives the state at each grid time before its step (x_k at grid[k])."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver '{solver}'; choose one of {', '.join(SOLVERS)}")
    x = noise
    batch = noise.shape[0]
    for i in range(len(grid) - 1):
        t, t_next = grid[i], grid[i + 1]
        if states is not None:
            states.append(x)
        dt = (t_next - t).to(x.dtype)
        v = velocity(x, t.expand(batch))
        if solver == "heun" and t_next > 0:
            x_pred = x + dt * v
            v_next = velocity(x_pred, t_next.expand(batch))
            x = x + dt * 0.5 * (v + v_next)
        else:
            x = x + dt * v
    return x


@torch.no_grad()
def sample_sde(
    velocity: VelocityFn,
    noise: torch.Tensor,
    grid: torch.Tensor,
    noise_level: float,
    sde_steps: torch.Tensor,
    step_noise: torch.Tensor,
    groups: tuple[torch.Tensor, ...] = (),
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Euler with Flow-GRPO's SDE on the steps `sde_steps` ([T] bool; the last step must stay
    deterministic) and the ODE elsewhere. `step_noise` [B, number of SDE steps, *latent] is each SDE
    step's z, in order. Returns (x0, the visited states [B, T, *latent] (x_k at grid[k]), each
    step's log-probability [B, T] under the sampling weights, 0 on the ODE steps; [B, T, G] with
    `groups`, one over each group's entries: per-modality credit's modalities)."""
    from ..algorithms.flow_grpo import sde_step

    steps = len(grid) - 1
    if sde_steps.shape != (steps,):
        raise ValueError(f"sde_steps has shape {tuple(sde_steps.shape)}; expected ({steps},)")
    if bool(sde_steps[-1]):
        raise ValueError("the last step (to t = 0) has no SDE form: keep it deterministic")
    if step_noise.shape[1] != int(sde_steps.sum()):
        raise ValueError(
            f"step_noise has {step_noise.shape[1]} steps of noise for {int(sde_steps.sum())} SDE steps"
        )
    x, batch, t_cap = noise, noise.shape[0], float(grid[1])
    grid = grid.to(noise.device)  # the policy's grid is made on the CPU
    per_group = (len(groups),) if groups else ()
    groups = tuple(index.to(noise.device) for index in groups)  # moved once, not at every step
    states, log_probs, used = [], torch.zeros(batch, steps, *per_group, device=noise.device), 0
    for i in range(steps):
        t, t_next = grid[i].expand(batch), grid[i + 1].expand(batch)
        states.append(x)
        v = velocity(x, t)
        if bool(sde_steps[i]):
            z = step_noise[:, used].to(device=x.device, dtype=torch.float32)
            x, log_probs[:, i], _, _ = sde_step(
                v.float(), x.float(), t, t_next, noise_level, t_cap, noise=z, groups=groups
            )
            used += 1
        else:
            x = x + (t_next[0] - t[0]).to(x.dtype) * v
    return x, torch.stack(states, dim=1), log_probs
