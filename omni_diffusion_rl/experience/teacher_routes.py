"""Teachers per part of the latent (`teacher.routes`): a video teacher for the picture, an audio
teacher for the sound, each with its own servers, answering as one teacher.

The student's layout names the parts of its flat latent (`teacher.latent_parts`); every part must
be in exactly one route, whose teacher answers for it, or in a route named `none`, which no teacher
answers and distillation leaves alone (`RoutedTeacher.answered` says which entries a teacher
answers for; the loss is taken over those only).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..config import NO_TEACHER, ConfigError
from ..teacher import Teacher, TeacherInfo

TEACHER_MASK = "teacher_mask"
"""Rollout extra [N, *latent] bool: the entries a teacher answered for (routes with a `none`)."""


def route_entries(
    parts: dict[str, tuple[int, int]] | None, routes: dict[str, Any], latent_shape: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """Each route's latent entries (flat indices), refused unless the latent is flat with named
    parts, every part is in exactly one route and every named part exists."""
    if parts is None or len(latent_shape) != 1:
        raise ConfigError(
            "teacher.routes: the student's latent names no parts to route (only the built-in tiny "
            "model's flat latent does: picture, visibility, spectrum, loudness); use one teacher "
            "without routes"
        )
    named = {part: route for route, spec in routes.items() for part in spec["parts"]}
    unknown = sorted(set(named) - set(parts))
    if unknown:
        raise ConfigError(
            f"teacher.routes: the latent has no part {unknown}; its parts are {', '.join(parts)}"
        )
    missing = [part for part in parts if part not in named]
    if missing:
        raise ConfigError(
            f"teacher.routes: no route for {missing}: every part of the latent needs exactly one teacher, "
            f"or a route with name: {NO_TEACHER} for the parts left out of distillation"
        )
    return {
        route: torch.cat([torch.arange(*parts[part]) for part in spec["parts"]])
        for route, spec in routes.items()
    }


class RoutedTeacher:
    """One teacher made of several, each answering for its route's entries of the flat latent; the
    entries of `none` routes are answered 0 and marked unanswered in `answered`."""

    def __init__(
        self,
        teachers: dict[str, Teacher | None],
        entries: dict[str, torch.Tensor],
        dim: int,
        concurrent: bool = False,
    ) -> None:
        """`concurrent`: ask the routes at once, a thread each (server pools; an in-process teacher,
        which may be sharded with collectives in a fixed order, is asked in turn)."""
        self.teachers, self.entries, self.dim = teachers, entries, dim
        self.answered = torch.zeros(dim, dtype=torch.bool)
        for route, teacher in teachers.items():
            if teacher is not None:
                self.answered[entries[route]] = True
        asked = [route for route, teacher in teachers.items() if teacher is not None]
        if not asked:
            raise ConfigError(f"teacher.routes: every route is {NO_TEACHER}; at least one needs a teacher")
        self._pool = ThreadPoolExecutor(len(asked), "odrl-route") if concurrent and len(asked) > 1 else None

    def info(self) -> TeacherInfo:
        infos = {route: t.info() for route, t in self.teachers.items() if t is not None}
        first = next(iter(infos.values()))
        prints = ",".join(f"{route}={info.fingerprint}" for route, info in infos.items())
        return TeacherInfo(first.latent_shape, first.layout, first.convention, f"routes({prints})")

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """Each route's teacher's velocity on its entries, 0 on the entries of `none` routes."""
        asked = {route: teacher for route, teacher in self.teachers.items() if teacher is not None}
        if self._pool is not None:
            futures = {
                r: self._pool.submit(teacher.velocity, x_t, t, prompts) for r, teacher in asked.items()
            }
            answers = {route: future.result() for route, future in futures.items()}
        else:
            answers = {route: teacher.velocity(x_t, t, prompts) for route, teacher in asked.items()}
        out = torch.zeros(x_t.shape, dtype=torch.float32, device=x_t.device)
        for route, v in answers.items():
            if v.shape != x_t.shape:
                raise ValueError(
                    f"teacher route '{route}' answered {tuple(v.shape)} for states {tuple(x_t.shape)}"
                )
            index = self.entries[route].to(x_t.device)
            out[:, index] = v.to(out.device, torch.float32)[:, index]
        return out

    def stats(self) -> dict[str, float]:
        """Each route's teacher counters (replicas, retries), under teacher/<route>/."""
        out = {}
        for route, teacher in self.teachers.items():
            stats = getattr(teacher, "stats", None)
            if callable(stats):
                out |= {f"teacher/{route}/{k.removeprefix('teacher/')}": v for k, v in stats().items()}
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        for teacher in self.teachers.values():
            close = getattr(teacher, "close", None)
            if callable(close):
                close()
