"""Measure a job's unit costs on this machine, for the simulator (and for auto mode's warm-up).

Generation (generate + decode + rewards, with the rollout weights) and training (one real update of
the run's algorithm on what was generated) are timed at 1 prompt group (what a rollout process
makes per call) and at a colocated process's share of a step, at a short and a long sampling-step
count (or one); the linear cost model is fitted by least squares and extrapolates to a whole step
on one trainer; measured at one length, the points themselves are kept and interpolated
(costs.py). The run's experience kind (trainers/experience_kinds.py) says how a rollout is timed
and may change the length unit: for an answering policy (GSPO) it is the answer token, generation is
timed at the run's own answer lengths (natural, or forced by algorithm.min_new_tokens) and the
length is their measured mean. The sync cost is the round trip of the algorithm's rollout weights through a
safetensors payload (what a weight sync moves); switching is a switch to the rollout weights and
back.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from ...config import ExperimentConfig
from ...trainers.update_batch import UpdateBatch
from .costs import CostModel


def _median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds of `repeats` calls after a warm-up call, and the last call's result."""
    out = fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def _least_squares(rows: list[list[float]], y: list[float]) -> list[float]:
    """Non-negative coefficients of y ~ rows (clamped at 0: a cost cannot be negative)."""
    solution = torch.linalg.lstsq(
        torch.tensor(rows, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    )
    return [max(0.0, float(v)) for v in solution.solution.flatten()]


def measure_costs(
    cfg: ExperimentConfig,
    short_steps: int,
    long_steps: int,
    repeats: int = 3,
    threads: int | None = None,
    replicas: int = 2,
    device: torch.device | None = None,
) -> CostModel:
    """Unit costs of `cfg`'s job on this machine (length unit: one sampling step), timed with
    `threads` intra-op threads: what one of several processes sharing the machine gets."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or previous)
    try:
        return _measure(cfg, short_steps, long_steps, repeats, replicas, device)
    finally:
        torch.set_num_threads(previous)


def _measure(
    cfg: ExperimentConfig,
    short_steps: int,
    long_steps: int,
    repeats: int,
    replicas: int,
    device: torch.device | None,
) -> CostModel:
    from ...trainers.trainer import Trainer

    trainer = Trainer(cfg, device=device)
    k = cfg.data.group_size
    p = cfg.data.prompts_per_step
    share = max(1, -(-p // replicas))  # a colocated process's groups per step
    prompts = [trainer.prompt_at(i) for i in range(max(p, 2))]
    fraction = cfg.algorithm.timestep_fraction
    unit = trainer.kind.cost_length(trainer, prompts, share, short_steps)  # None: the sampling step
    if unit is not None:  # another length unit (answer tokens), measured as the run's outputs come out
        short_steps = long_steps = unit  # type: ignore[assignment]
        fraction = 1.0  # every unit is trained
    gen_rows, gen_y, train_rows, train_y = [], [], [], []
    for steps in sorted({short_steps, long_steps}):  # one length is enough to predict at that length
        for groups in sorted({1, share, 2 if share == 1 else share}):
            rollout = trainer.kind.cost_rollout(trainer, prompts, groups, steps)
            seconds, batch = _median_time(rollout, repeats)
            gen_rows.append([1.0, groups * k * steps])
            gen_y.append(seconds)
            trained_steps = max(1, int(steps * fraction))
            train_rows.append([1.0, groups * k, groups * k * trained_steps])
            train_y.append(_median_time(_update_fn(trainer, batch), repeats)[0])

    algorithm, experience = trainer.algorithm, trainer.experience

    def sync() -> None:  # the rollout weights through a wire payload and into a model
        tensors = algorithm.rollout_state(trainer.transformer)
        payload = save_tensors({k: v.contiguous() for k, v in tensors.items()})
        experience.load_rollout_state(load_tensors(payload))

    def switch() -> None:  # to the rollout weights and back
        with experience.rollout_weights():
            pass

    gen_fixed, gen_unit = _least_squares(gen_rows, gen_y)
    train_fixed, train_sample, train_unit = _least_squares(train_rows, train_y)
    trainer.close_scorers()
    points = {}
    if short_steps == long_steps:  # one length: the measured points themselves (see costs.py)
        points = {
            "gen_points": tuple((row[1] / short_steps, y) for row, y in zip(gen_rows, gen_y, strict=True)),
            "train_points": tuple((row[1], y) for row, y in zip(train_rows, train_y, strict=True)),
            "points_length": float(short_steps),
        }
    return CostModel(
        gen_fixed_s=gen_fixed,
        gen_per_unit_s=gen_unit,
        length=float(short_steps),
        train_fixed_s=train_fixed,
        train_per_sample_s=train_sample,
        sync_s=_median_time(sync, repeats)[0],
        # trained timesteps per sampling step: the model's length unit is the sampling step
        train_per_unit_s=train_unit * fraction,
        switch_s=_median_time(switch, repeats)[0],
        **points,
    )


def _update_fn(trainer: Any, batch: Any) -> Callable[[], Any]:
    """A call that runs the algorithm's update on `batch` (random rewards, every sample trained)."""
    rewards = torch.rand(len(batch), generator=torch.Generator().manual_seed(1))
    keep = torch.ones(len(batch), dtype=torch.bool)
    whole = UpdateBatch(
        batch,
        rewards,
        batch.group_ids,
        keep,
        slice(0, len(batch)),
        0,
        {"random": rewards},
        {"random": 1.0},
        {"random": "audio_video"},  # judges both, so that per-modality credit has each modality's
    )
    return lambda: trainer.algorithm.update(whole)


def costs_to_json(costs: CostModel) -> dict[str, Any]:
    """The cost model as JSON (CostModel(**it) reads it back)."""
    out: dict[str, Any] = {}
    for name, value in dataclasses.asdict(costs).items():
        if isinstance(value, tuple | list):
            out[name] = [[round(x, 6), round(y, 6)] for x, y in value]
        else:
            out[name] = round(value, 6)
    return out
