"""Teacher targets for a generated chunk, computed where the chunk is made: the teacher's velocity
at every state the distillation trains on, attached to the rollout as extras so that it travels
with the group (through the replay buffer in the async modes).

`TeacherTargets.submit` returns a future: the teacher works on a thread of its own while the next
chunk generates (colocated mode overlaps the two; a rollout process does the same). States are the
ones the student's sampler visited (`extras["states"]`, recorded by `generate`) or its x0
forward-noised at each grid time with noise keyed by the prompt group. The targets are the
teacher's velocity at each state (`velocity`) or, with `endpoint`, the straight-line velocity from
each visited state to the teacher's own sample from the student's starting noise (the teacher's
Euler trajectory on the student's time grid: the same number of teacher forwards), or with
`completion` to the teacher's own completion from that state (its Euler run from there to the end
of the grid), for a few visited states of each sample (`COMPLETED` marks them). With `contrast`
there are no velocity targets: each sample's completion by the teacher from one visited state
(`TEACHER_X0`), which DiffusionNFT's loss then treats as the positive to the student's sample.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from ..algorithm_options import DISTILL_TARGETS, STATE_KINDS
from ..algorithms.distill import completion_velocities, endpoint_velocities
from ..config import NO_TEACHER, ConfigError, ExperimentConfig
from ..runtime.sharding import compute_device
from ..teacher import (
    CONVENTION,
    Teacher,
    TeacherInfo,
    TeacherMismatch,
    check_pair,
    check_trained_parts,
    latent_layout,
    latent_parts,
    probe_convention,
)
from .rollout import STATES, Rollout, step_generator
from .teacher_routes import TEACHER_MASK, RoutedTeacher, route_entries

TEACHER_V = "teacher_v"
COMPLETED = "teacher_completed"
"""[N, T] bool: the visited states a completion target was made for (distill_target=completion)."""
TEACHER_V_EMPTY = "teacher_v_empty"
"""[N, T, *latent]: the teacher's velocity at the same states for the empty prompt (the conditional
direction's reference, algorithm.distill_cond_coef)."""
TEACHER_X0 = "teacher_x0"
"""[N, *latent]: the teacher's completion of each sample from one of its visited states (contrast)."""


def noised_states(rollout: Rollout, seed: int) -> torch.Tensor:
    """[N, T, *latent]: x0 forward-noised to each sampler time grid[k] (k < T) with group_noise."""
    return forward_noised(rollout.x0, group_noise(rollout, seed), rollout.grid[:-1])


def forward_noised(x0: torch.Tensor, noise: torch.Tensor, times: torch.Tensor) -> torch.Tensor:
    """[N, T, *latent]: x_t = (1 - t) x0 + t noise for x0 [N, ...], noise [N, T, ...], times [T]."""
    t = times.to(x0.device).view(1, -1, *([1] * (x0.ndim - 1)))
    return (1 - t) * x0[:, None] + t * noise.to(x0.device)


def group_noise(rollout: Rollout, seed: int) -> torch.Tensor:
    """[N, T, *latent]: one noise per sample and grid time (k < T), drawn from (seed, its prompt
    group), so it does not depend on where or when it is made, nor on the sample itself."""
    times = rollout.grid[:-1]
    group_size = max(1, int((rollout.group_ids == rollout.group_ids[0]).sum()))
    noises = []
    for start in range(0, len(rollout), group_size):
        gen = step_generator(seed, 0, int(rollout.group_ids[start]), "distill")
        shape = (len(times), min(group_size, len(rollout) - start), *rollout.x0.shape[1:])
        noises.append(torch.randn(shape, generator=gen).transpose(0, 1))
    return torch.cat(noises).to(rollout.x0.device)


def completion_starts(rollout: Rollout, seed: int, count: int) -> torch.Tensor:
    """[N, T] bool: `count` of each sample's T visited states, drawn without replacement from (seed,
    its prompt group), so the choice does not depend on where or when it is made."""
    steps = len(rollout.grid) - 1
    if not 1 <= count <= steps:
        raise ValueError(f"completion targets need 1 to {steps} states per sample (the grid's); got {count}")
    group_size = max(1, int((rollout.group_ids == rollout.group_ids[0]).sum()))
    chosen = torch.zeros(len(rollout), steps, dtype=torch.bool)
    for start in range(0, len(rollout), group_size):
        gen = step_generator(seed, 0, int(rollout.group_ids[start]), "completion")
        for row in range(start, min(start + group_size, len(rollout))):
            chosen[row, torch.randperm(steps, generator=gen)[:count]] = True
    return chosen


def checked_targets(v: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """The teacher's answer as float32 on the states' device, refused unless it has their shape and
    is finite (a failed teacher is an error, never a silent target)."""
    if v.shape != states.shape or not torch.isfinite(v).all():
        finite = bool(torch.isfinite(v).all()) if v.is_floating_point() else "not floating point"
        raise ValueError(
            f"the teacher answered {tuple(v.shape)} (finite: {finite}) for states {tuple(states.shape)}: "
            "a teacher must give a finite velocity per state"
        )
    return v.detach().to(states.device, torch.float32)


def built_teacher(
    cfg: ExperimentConfig,
    name: str,
    options: dict[str, Any],
    urls: list[str],
    sharder: Any = None,
    route: str | None = None,
) -> Teacher:
    """A teacher by its config (`route`: the teacher.routes entry it comes from): served at `urls`
    (routed across them), else `name` in process with `options` (sharded over the training
    processes when a `sharder` is given and it can be)."""
    import os

    from ..registry import teachers

    c = cfg.teacher
    if urls:
        from ..serving.teacher_client import RemoteTeacher

        return RemoteTeacher(
            urls,
            name,
            os.environ.get(c.token_env) or None,
            c.timeout_s,
            c.retries,
            c.request_samples,
            c.health_every_s,
            token_env=c.token_env,  # named when a server refuses the token
        )
    try:
        teacher = teachers.create(name, **options)
    except TypeError as e:  # an option the teacher does not take
        where = "teacher.options" if route is None else f"teacher.routes.{route}.options"
        raise ConfigError(
            f"{where}: teacher '{name}' could not be created with {sorted(options)} ({e})"
        ) from e
    place = getattr(teacher, "shard", None)
    if sharder is not None and callable(place):
        place(sharder)
    return teacher


def make_checked_teacher(cfg: ExperimentConfig, policy: object, sharder: Any = None) -> Teacher:
    """The config's teacher, refused unless it fits the student: the same latent shape, layout and
    convention, and both pass the convention probe (which catches a flipped velocity sign). With
    teacher.routes, one teacher per route, each checked, answering together for the parts of the
    latent their routes name (teacher_routes.py). With a `sharder` (sharding.Sharder: the training
    processes shard), an in-process teacher that can be sharded (it has `shard(sharder)`) is split
    over the training processes too, forward only."""
    c = cfg.teacher
    student = TeacherInfo(
        latent_shape=tuple(policy.latent_shape),  # type: ignore[attr-defined]
        layout=latent_layout(policy),
        convention=CONVENTION,
        fingerprint="student",
    )
    prompts = ["a red circle", "a low tone"]

    def student_velocity(x: torch.Tensor, t: torch.Tensor, texts: list[str]) -> torch.Tensor:
        device = compute_device(policy.transformer)  # type: ignore[attr-defined]
        cond = {k: v.to(device) for k, v in policy.encode_prompts(texts).items()}  # type: ignore[attr-defined]
        return policy.velocity(x.to(device), t.to(device), cond)  # type: ignore[attr-defined]

    if not c.routes:
        teacher = built_teacher(cfg, c.name, c.options, c.urls, sharder)
        check_pair(student, teacher.info())
        check_trained_parts(teacher.info(), list(latent_parts(policy) or {}), f"teacher '{c.name}'")
        probe_convention(student_velocity, student.latent_shape, prompts, "student")
        probe_convention(teacher.velocity, student.latent_shape, prompts, f"teacher '{c.name}'")
        return teacher
    probe_convention(student_velocity, student.latent_shape, prompts, "student")
    if c.options:
        raise ConfigError("teacher.options is not used with teacher.routes: give each route its options")
    entries = route_entries(latent_parts(policy), c.routes, student.latent_shape)
    members: dict[str, Teacher | None] = {}
    for route, spec in c.routes.items():
        name = spec.get("name", "policy")
        if name == NO_TEACHER:
            members[route] = None
            continue
        member = built_teacher(cfg, name, spec.get("options", {}), spec.get("urls", []), sharder, route)
        try:
            check_pair(student, member.info())
        except TeacherMismatch as e:
            raise TeacherMismatch(f"teacher route '{route}': {e}") from e
        who = f"teacher of route '{route}' ({', '.join(spec['parts'])})"
        check_trained_parts(member.info(), list(spec["parts"]), who)
        probe_convention(member.velocity, student.latent_shape, prompts, who, entries[route])
        members[route] = member
    remote = all(spec.get("urls") or spec.get("name") == NO_TEACHER for spec in c.routes.values())
    dim = int(torch.Size(student.latent_shape).numel())
    return RoutedTeacher(members, entries, dim, concurrent=remote)


class TeacherTargets:
    """Annotates rollouts with `teacher_v` [N, T, *latent] (and `states` when noised) on a worker
    thread (overlap=False: at once, blocking); `seconds` and `calls` say how much teacher time
    there was."""

    def __init__(
        self,
        teacher: Teacher,
        states: str = "visited",
        seed: int = 0,
        max_batch: int = 256,
        overlap: bool = True,
        target: str = "velocity",
        completions: int = 3,
        contrast_from: float = 0.8,
        same_forwards: bool = False,
        empty_prompt: bool = False,
    ) -> None:
        if states not in STATE_KINDS:
            raise ValueError(f"distillation states must be one of {', '.join(STATE_KINDS)}; got {states!r}")
        if target not in DISTILL_TARGETS:
            raise ValueError(
                f"distillation targets must be one of {', '.join(DISTILL_TARGETS)}; got {target!r}"
            )
        if target in ("completion", "contrast") and states != "visited":
            raise ValueError(f"{target} targets start from the visited states: use distill_states=visited")
        self.teacher, self.target, self.completions = teacher, target, completions
        # a teacher sharded over the training processes gathers in lockstep: every process must
        # run the same forwards, whatever completions its own groups start where
        self.contrast_from, self.same_forwards = contrast_from, same_forwards
        if empty_prompt and target != "velocity":
            raise ValueError("the empty prompt's velocities go with distill_target=velocity")
        self.empty_prompt = empty_prompt  # also the teacher's velocity for "" at every state
        self.states, self.seed, self.max_batch = states, seed, max_batch
        # endpoint targets start the teacher from the student's own noise, the first visited state
        self.needs_states = states == "visited" or target != "velocity"
        self.overlap = overlap
        self.seconds, self.calls, self._reported = 0.0, 0, 0.0
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="odrl-teacher")

    def submit(self, rollout: Rollout) -> Future[dict[str, torch.Tensor]]:
        if self.overlap:
            return self._pool.submit(self.targets, rollout)
        done: Future[dict[str, torch.Tensor]] = Future()  # blocking: answered before generation goes on
        done.set_result(self.targets(rollout))
        return done

    @torch.no_grad()  # grad mode is per thread: this runs on the teacher's own thread
    def targets(self, rollout: Rollout) -> dict[str, torch.Tensor]:
        """The teacher's velocity at each state of each sample, or the straight-line velocity to its
        sample (blocking)."""
        started = time.perf_counter()
        if self.needs_states and STATES not in rollout.extras:
            raise ValueError(
                "visited-state and endpoint distillation need the sampler's states "
                "(generate(record_states=True))"
            )
        if self.states == "visited" or self.target == "endpoint":  # endpoint: noised below if asked
            states, extras = rollout.extras[STATES], {}
        else:
            states = noised_states(rollout, self.seed)
            extras = {STATES: states}
        times = rollout.grid[:-1].to(states.device)
        answered = self.teacher.answered if isinstance(self.teacher, RoutedTeacher) else None
        if answered is not None and not bool(answered.all()):  # routes with no teacher: left alone
            shape = (len(states), *states.shape[2:])
            extras[TEACHER_MASK] = answered.to(states.device).view(shape[1:]).expand(shape).contiguous()
        if self.target in ("completion", "contrast"):
            if self.target == "completion":
                chosen = completion_starts(rollout, self.seed, self.completions).to(states.device)
            else:  # one start per sample: the visited state nearest contrast_from
                chosen = torch.zeros(states.shape[:2], dtype=torch.bool, device=states.device)
                chosen[:, int((times - self.contrast_from).abs().argmin())] = True
            rows, starts = chosen.nonzero(as_tuple=True)
            x0 = self._complete(rollout, states, rows, starts, extras.get(TEACHER_MASK))
            self.seconds += time.perf_counter() - started
            self.calls += 1
            if self.target == "contrast":
                return {**extras, TEACHER_X0: x0}
            target = torch.zeros_like(states, dtype=torch.float32)
            target[rows, starts] = completion_velocities(states[rows, starts].float(), x0, times[starts])
            return {**extras, COMPLETED: chosen, TEACHER_V: target}
        if self.target == "endpoint":
            # the teacher's own sample: its completion from the student's starting noise, state 0
            everyone = torch.arange(len(states), device=states.device)
            x0 = self._complete(
                rollout, states, everyone, torch.zeros_like(everyone), extras.get(TEACHER_MASK)
            )
            if self.states == "noised":  # flow matching on the teacher's samples, noise keyed by group
                noise = group_noise(rollout, self.seed).to(x0.device, x0.dtype)
                extras[STATES] = forward_noised(x0, noise, times)
                target = noise - x0[:, None]
            else:
                target = endpoint_velocities(states.float(), x0, times)
            self.seconds += time.perf_counter() - started
            self.calls += 1
            return {**extras, TEACHER_V: target}
        # time-major: a batch shares one time, as the student trains; every answer is checked once
        # all are in, so that a sharded teacher runs the same forwards on every process even when
        # one process's answers are bad (its error then comes after the others' last gather)
        answers = [self._answers(states[:, k].detach(), t, rollout.prompts) for k, t in enumerate(times)]
        if self.empty_prompt:
            empty = [""] * len(rollout)
            answers += [self._answers(states[:, k].detach(), t, empty) for k, t in enumerate(times)]
        columns = [torch.cat([checked_targets(v, piece) for v, piece in column]) for column in answers]
        self.seconds += time.perf_counter() - started
        self.calls += 1
        if self.empty_prompt:
            steps = len(times)
            extras[TEACHER_V_EMPTY] = torch.stack(columns[steps:], dim=1)
            columns = columns[:steps]
        return {**extras, TEACHER_V: torch.stack(columns, dim=1)}

    def _complete(
        self,
        rollout: Rollout,
        states: torch.Tensor,
        rows: torch.Tensor,
        starts: torch.Tensor,
        answered: torch.Tensor | None,
    ) -> torch.Tensor:
        """[M, ...]: the teacher's Euler completion on the rollout's grid from each visited state
        states[rows[m], starts[m]] (from state 0 of every row: the teacher's own sample from the
        student's starting noise, the endpoint target's). The completions run in lockstep, one batch
        per grid time with every completion started by then; entries no teacher answers (a `none`
        route) follow the student's states. Answers are checked after the last forward. With
        `same_forwards` every completion is asked at every grid time (the answers before its start
        unused), so that the forwards do not depend on which states this process's groups start
        from."""
        grid = rollout.grid.to(states.device)
        if states.shape[1] != len(grid) - 1:
            raise ValueError(
                f"the sampler recorded {states.shape[1]} states for a grid of {len(grid) - 1} steps: "
                f"{self.target} targets need one state per step"
            )
        x = states[rows, starts].detach().float()
        answers = []
        everyone = torch.arange(len(rows), device=rows.device)
        for k in range(len(grid) - 1):
            active = (starts <= k).nonzero(as_tuple=True)[0]
            asked = everyone if self.same_forwards else active
            if not len(asked):
                continue
            column = self._answers(x[asked], grid[k], [rollout.prompts[int(r)] for r in rows[asked]])
            answers.append(column)
            v = torch.cat([_raw_or_nan(raw, piece) for raw, piece in column])
            if self.same_forwards:
                v = v[active]
            stepped = x[active] + (grid[k + 1] - grid[k]) * v
            if answered is not None:
                after = states[:, k + 1] if k + 1 < states.shape[1] else rollout.x0.to(x.device)
                stepped = torch.where(answered[rows[active]], stepped, after[rows[active]].float())
            x[active] = stepped
        for column in answers:
            for raw, piece in column:
                checked_targets(raw, piece)
        return x

    def _answers(
        self, x: torch.Tensor, t: torch.Tensor, prompts: list[str]
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The teacher's raw velocity for states x [N, ...] (one time t), in batches of max_batch,
        each with its states."""
        out = []
        for start in range(0, len(x), self.max_batch):
            piece = x[start : start + self.max_batch]
            out.append(
                (
                    self.teacher.velocity(piece, t.expand(len(piece)), prompts[start : start + len(piece)]),
                    piece,
                )
            )
        return out

    def metrics(self) -> dict[str, float]:
        """Teacher seconds since the last call, and the teacher's own counters (replicas, retries)."""
        seconds, self._reported = self.seconds - self._reported, self.seconds
        stats = getattr(self.teacher, "stats", None)
        return {"teacher/seconds": seconds, **(stats() if callable(stats) else {})}

    def totals(self) -> dict[str, float]:
        """Teacher seconds and the teacher's own counters since the start."""
        stats = getattr(self.teacher, "stats", None)
        return {"teacher/seconds": self.seconds, **(stats() if callable(stats) else {})}

    def close(self) -> None:
        """Stop the teacher's thread (queued work is dropped) and close the teacher's connections."""
        self._pool.shutdown(wait=True, cancel_futures=True)
        close = getattr(self.teacher, "close", None)
        if callable(close):
            close()


def _raw_or_nan(raw: torch.Tensor, piece: torch.Tensor) -> torch.Tensor:
    """A teacher's answer for `piece` as float32 on its device, NaN when it has the wrong shape (the
    check after the last forward names it)."""
    if raw.shape != piece.shape:
        return torch.full_like(piece, float("nan"), dtype=torch.float32)
    return raw.detach().to(piece.device, torch.float32)
