"""Teachers for on-policy distillation: frozen models that answer velocity targets for a student's
states, and the checks that a teacher fits a student.

A teacher answers `velocity(x_t, t, prompts)` in the project's convention (x_t = (1 - t) x0 + t eps,
v = eps - x0, t = 1 noise) and describes itself with `TeacherInfo`: the latent shape and layout it
works in, its convention and a fingerprint of its model. Teachers are registered by name
(`omni_diffusion_rl.registry.teachers`, entry-point group `omni_diffusion_rl.teachers`); the
built-in ones live in the top-level `teachers` package.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Protocol, runtime_checkable

import torch

CONVENTION = "flow: x_t = (1 - t) x0 + t noise, v = noise - x0, t = 1 noise"
"""The only convention teachers and students use here (adapters convert models that differ)."""
MAX_PARTS = 32
"""The most latent parts a teacher may name as trained (TeacherInfo.trained_parts)."""
_PART_NAME = re.compile(r"[a-z0-9_]{1,64}")


def part_names_problem(parts: object) -> str | None:
    """Why `parts` is not 1 to MAX_PARTS distinct part names (lower-case letters, digits, _), or None."""
    if (
        isinstance(parts, list)
        and 0 < len(parts) <= MAX_PARTS
        and all(isinstance(p, str) and _PART_NAME.fullmatch(p) for p in parts)
        and len(set(parts)) == len(parts)
    ):
        return None
    return (
        f"parts must be 1 to {MAX_PARTS} distinct names of lower-case letters, digits and _; "
        f"got {str(parts)[:80]}"
    )


PROBE_MIN_COSINE = 0.2
"""cos(v(noise, t = 1), noise) of a sane model is clearly positive (v = noise - E[x0])."""


class TeacherMismatch(ValueError):
    """The teacher cannot teach this student: another latent layout, convention or a failed probe."""


@dataclass(frozen=True)
class TeacherInfo:
    latent_shape: tuple[int, ...]
    layout: str  # what the latent's entries mean (model family and data dimensions)
    convention: str
    fingerprint: str  # of the teacher's weights and config
    trained_parts: tuple[str, ...] | None = None  # the latent parts it was trained on (None: all)

    def to_dict(self) -> dict[str, Any]:
        parts = None if self.trained_parts is None else list(self.trained_parts)
        return {**asdict(self), "latent_shape": list(self.latent_shape), "trained_parts": parts}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TeacherInfo:
        """A description received from a teacher (a server's /info), each field checked; a
        TeacherMismatch names the first field that is missing or not what it must be."""
        problem = _description_problem(data)
        if problem:
            raise TeacherMismatch(f"a teacher described itself with {problem}: {data!r:.300}")
        parts = data.get("trained_parts")
        return cls(
            latent_shape=tuple(data["latent_shape"]),
            layout=data["layout"],
            convention=data["convention"],
            fingerprint=data["fingerprint"],
            trained_parts=None if parts is None else tuple(parts),
        )


MAX_LATENT_DIMS = 8
MAX_LATENT_DIM = 2**31 - 1
MAX_DESCRIPTION_CHARS = 4096  # layout, convention and fingerprint


def _description_problem(data: object) -> str | None:
    """What is wrong with a teacher's description (a dict from JSON), or None."""
    if not isinstance(data, dict):
        return f"a {type(data).__name__} instead of an object"
    shape = data.get("latent_shape")
    if not (
        isinstance(shape, list)
        and 0 < len(shape) <= MAX_LATENT_DIMS
        and all(type(d) is int and 0 < d <= MAX_LATENT_DIM for d in shape)
    ):
        return (
            f"latent_shape {str(shape)[:80]} (it must be a list of 1 to {MAX_LATENT_DIMS} whole numbers "
            f"from 1 to {MAX_LATENT_DIM})"
        )
    for name in ("layout", "convention", "fingerprint"):
        value = data.get(name)
        if not (isinstance(value, str) and 0 < len(value) <= MAX_DESCRIPTION_CHARS):
            return f"{name} {str(value)[:80]} (it must be text of 1 to {MAX_DESCRIPTION_CHARS} characters)"
    parts = data.get("trained_parts")
    problem = None if parts is None else part_names_problem(parts)
    return f"trained_parts: {problem}" if problem else None


@runtime_checkable
class Teacher(Protocol):
    def info(self) -> TeacherInfo: ...

    def velocity(self, x_t: torch.Tensor, t: torch.Tensor, prompts: list[str]) -> torch.Tensor:
        """[B, *latent] float32 velocity targets at the states x_t [B, *latent] and times t [B]."""
        ...


def latent_layout(policy: object) -> str:
    """What a policy's latent entries mean: its class and, for the built-in tiny model, the clip
    dimensions its fixed decoder encodes (independent of the network's width or depth)."""
    layout = getattr(getattr(policy, "transformer", None), "layout", None)
    shape = tuple(getattr(policy, "latent_shape", ()))
    if layout is not None and hasattr(layout, "describe"):
        return f"{type(policy).__name__}:{layout.describe()}"
    return f"{type(policy).__name__}:{shape}"


def latent_parts(policy: object) -> dict[str, tuple[int, int]] | None:
    """The named parts of a policy's flat latent and where each lies, [start, stop) (the built-in
    tiny model's: picture, visibility, spectrum, loudness); None when its layout names none."""
    layout = getattr(getattr(policy, "transformer", None), "layout", None)
    parts = getattr(layout, "parts", None)
    return parts() if callable(parts) else None


def check_pair(student: TeacherInfo, teacher: TeacherInfo) -> None:
    """Refuse a teacher whose latents mean something else than the student's."""
    problems = []
    if student.latent_shape != teacher.latent_shape:
        problems.append(f"latent shape {teacher.latent_shape} against the student's {student.latent_shape}")
    if student.layout != teacher.layout:
        problems.append(f"latent layout '{teacher.layout}' against the student's '{student.layout}'")
    if student.convention != teacher.convention:
        problems.append(f"convention '{teacher.convention}' against '{student.convention}'")
    if problems:
        raise TeacherMismatch("the teacher does not fit the student: " + "; ".join(problems))


def check_trained_parts(info: TeacherInfo, needed: list[str], who: str) -> None:
    """Refuse a teacher asked for latent parts it was not trained on (their heads are untrained, and
    the convention probe cannot tell: an untrained head of a sample-predicting model passes it)."""
    if info.trained_parts is None:
        return
    if not needed:
        raise TeacherMismatch(
            f"the {who} was trained on {', '.join(info.trained_parts)} only, and the student's latent "
            "names no parts to route: use a teacher trained on the whole latent"
        )
    missing = [part for part in needed if part not in info.trained_parts]
    if missing:
        raise TeacherMismatch(
            f"the {who} was trained on {', '.join(info.trained_parts)} only, not {', '.join(missing)}: "
            "route it to its parts (teacher.routes) and give the others a teacher trained on them"
        )


def probe_convention(
    velocity: Any,
    latent_shape: tuple[int, ...],
    prompts: list[str],
    who: str,
    entries: torch.Tensor | None = None,
) -> float:
    """cos(v(noise, t = 1), noise) averaged over a few seeded draws, over the flat latent's `entries`
    (default: all); a flipped velocity sign (or a model that predicts x0 - noise) gives a negative
    value and is refused."""
    noise = torch.randn((len(prompts), *latent_shape), generator=torch.Generator().manual_seed(1234))
    with torch.no_grad():
        v = velocity(noise, torch.ones(len(prompts)), prompts).float().cpu()
    v, noise = v.flatten(1), noise.flatten(1)
    if entries is not None:
        v, noise = v[:, entries], noise[:, entries]
    cosine = float(torch.nn.functional.cosine_similarity(v, noise, dim=1).mean())
    if not cosine > PROBE_MIN_COSINE:
        raise TeacherMismatch(
            f"the {who} fails the convention probe: cos(v(noise, t=1), noise) = {cosine:.3f}, expected > "
            f"{PROBE_MIN_COSINE} for v = noise - x0 (a flipped velocity sign or time gives a negative value)"
        )
    return cosine
