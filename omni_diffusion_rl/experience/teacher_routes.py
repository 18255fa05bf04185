"""Teachers per part of the latent (`teacher.routes`): a video teacher for the picture, an audio
teacher for the sound, each with its own servers, answering as one teacher.

The student's layout names the parts (`teacher.latent_parts`); every part must be in exactly one
route, whose teacher answers for it, or in a route named `none`, which no teacher answers and
distillation leaves alone (`RoutedTeacher.answered` says which entries a teacher answers for).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import NO_TEACHER, ConfigError
from ..teacher import Teacher, TeacherInfo

TEACHER_MASK = "teacher_mask"
"""Rollout extra [N, *latent] bool: the entries a teacher answered for (routes with a `none`)."""


def route_entries(
    parts: dict[str, tuple[int, int]] | None, routes: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Each route's latent entries (flat indices), refused unless every part of the latent is in
    exactly one route and every named part exists."""
    if parts is None:
        raise ConfigError(
            "teacher.routes: the student's latent names no parts to route (only the built-in tiny "
            "model's does: picture, visibility, spectrum, loudness); use one teacher without routes"
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
    """One teacher made of several, each answering for its route's entries of the latent; the
    entries of `none` routes are answered 0 and marked unanswered in `answered`."""

    def __init__(
        self, teachers: dict[str, Teacher | None], entries: dict[str, torch.Tensor], dim: int
    ) -> None:
        self.teachers, self.entries, self.dim = teachers, entries, dim
        answered = torch.zeros(dim, dtype=torch.bool)
        for route, teacher in teachers.items():
            if teacher is not None:
                answered[entries[route]] = True
        self.answered = answered

    def info(self) -> TeacherInfo:
        infos = [t.info() for t in self.teachers.values() if t is not None]
        if not infos:
            raise ConfigError(f"teacher.routes: every route is {NO_TEACHER}; at least one needs a teacher")
        prints = ",".join(f"{r}={t.info().fingerprint}" for r, t in self.teachers.items() if t is not None)
        return TeacherInfo(infos[0].latent_shape, infos[0].layout, infos[0].convention, f"routes({prints})")

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        out = torch.zeros(x_t.shape, dtype=torch.float32, device=x_t.device)
        for route, teacher in self.teachers.items():
            if teacher is None:
                continue
            v = teacher.velocity(x_t, t, prompts)
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
        for teacher in self.teachers.values():
            close = getattr(teacher, "close", None)
            if callable(close):
                close()
