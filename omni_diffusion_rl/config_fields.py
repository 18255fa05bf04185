"""What every config section and every algorithm's options are made of, below both: the error a bad
value raises, a field with its doc and checks, and the check that a name is registered."""

from __future__ import annotations

from dataclasses import field
from typing import Any


class ConfigError(ValueError):
    """A config value, key or file that cannot be used."""


def config_field(default: Any, doc: str, **checks: Any) -> Any:
    """A field with a default, a one-line doc and checks: gt, ge, le, choices."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"doc": doc, **checks})
    return field(default=default, metadata={"doc": doc, **checks})


option = config_field
"""A field of an algorithm's options dataclass: default, one-line doc and checks (gt, ge, le, choices)."""

REWARD_MODALITIES = ("video", "audio", "audio_video")
"""What a reward may judge (reward.modalities; algorithms/credit.py routes them)."""

NO_TEACHER = "none"  # a teacher route's name for parts that no teacher answers (not distilled)


def check_registered_name(key: str, value: str, registry: Any) -> None:
    """A ConfigError unless `value` (given as `key`) names one of `registry`'s plug-ins."""
    if value not in registry.names():
        raise ConfigError(
            f"{key}: unknown {registry.kind} '{value}'; registered: {', '.join(registry.names())} "
            f"(register your own with @omni_diffusion_rl.registry.{registry.kind}s.register or the "
            f"entry-point group '{registry.entry_point_group}')"
        )
