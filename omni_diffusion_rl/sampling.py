"""Flow-matching ODE solvers on a (shifted) time grid; t = 1 is noise, t = 0 is data."""

from __future__ import annotations

from collections.abc import Callable

import torch

VelocityFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
SOLVERS = ("euler", "heun")


def shift_time(t: torch.Tensor, shift: float) -> torch.Tensor:
    """SD3-style resolution shift: t' = s t / (1 + (s - 1) t)."""
    return shift * t / (1 + (shift - 1) * t)


def time_grid(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """num_steps + 1 decreasing times from 1 to 0."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1; got {num_steps}")
    return shift_time(torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64), shift).float()


@torch.no_grad()
def sample_ode(
    velocity: VelocityFn, noise: torch.Tensor, grid: torch.Tensor, solver: str = "euler"
) -> torch.Tensor:
    """Integrate dx/dt = v(x, t) from t = grid[0] (noise) to grid[-1]; returns the final x (x0)."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver '{solver}'; choose one of {', '.join(SOLVERS)}")
    x = noise
    batch = noise.shape[0]
    for i in range(len(grid) - 1):
        t, t_next = grid[i], grid[i + 1]
        dt = (t_next - t).to(x.dtype)
        v = velocity(x, t.expand(batch))
        if solver == "heun" and t_next > 0:
            x_pred = x + dt * v
            v_next = velocity(x_pred, t_next.expand(batch))
            x = x + dt * 0.5 * (v + v_next)
        else:
            x = x + dt * v
    return x
