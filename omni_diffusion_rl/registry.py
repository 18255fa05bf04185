"""Plug-in registries: a decorator for code in this process, entry points for installed packages.

A third-party package registers a reward in its pyproject.toml:

    [project.entry-points."omni_diffusion_rl.rewards"]
    my_reward = "my_package.module:MyReward"
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib.metadata import entry_points
from typing import Any


class RegistryError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class Registry:
    """Names -> factories, filled by `@registry.register(name)` and by an entry-point group."""

    def __init__(self, kind: str, entry_point_group: str) -> None:
        self.kind = kind
        self.entry_point_group = entry_point_group
        self._factories: dict[str, Callable[..., Any]] = {}
        self._entry_points_loaded = False

    def register(
        self, name: str, *, overwrite: bool = False
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        def decorator(factory: Callable[..., Any]) -> Callable[..., Any]:
            existing = self._factories.get(name)
            # An entry point not yet loaded is replaced by the decorator of the module it names.
            clash = existing is not None and not isinstance(existing, _LazyEntryPoint)
            if clash and existing is not factory and not overwrite:
                owner = f"{existing.__module__}.{existing.__qualname__}"
                raise RegistryError(
                    f"{self.kind} '{name}' is already registered by {owner}; pass overwrite=True to replace"
                )
            self._factories[name] = factory
            return factory

        return decorator

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=self.entry_point_group):
            if ep.name not in self._factories:
                self._factories[ep.name] = _LazyEntryPoint(ep)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._factories)

    def loaded(self, name: str) -> Callable[..., Any] | None:
        """What `name` is registered as in this process, if its module has been imported (None for a
        name not registered, or an entry point not loaded yet): nothing is imported."""
        factory = self._factories.get(name)
        return None if isinstance(factory, _LazyEntryPoint) else factory

    def get(self, name: str) -> Callable[..., Any]:
        self._load_entry_points()
        if name not in self._factories:
            raise RegistryError(
                f"unknown {self.kind} '{name}'; registered: {', '.join(self.names()) or '(none)'}. "
                f"Register one with @{self.kind}s.register('{name}') or the entry-point group "
                f"'{self.entry_point_group}'."
            )
        factory = self._factories[name]
        if isinstance(factory, _LazyEntryPoint):
            with self._no_exit(name, "importing"):
                factory = self._factories[name] = factory.load()
        return factory

    def create(self, name: str, **kwargs: Any) -> Any:
        factory = self.get(name)
        with self._no_exit(name, "creating"):
            return factory(**kwargs)

    @contextmanager
    def _no_exit(self, name: str, doing: str) -> Iterator[None]:
        """A plug-in that calls sys.exit would end odrl without a word: a RegistryError says who."""
        try:
            yield
        except SystemExit as e:
            raise RegistryError(
                f"{doing} {self.kind} '{name}' called sys.exit({e.code!r}); a plug-in must raise an error "
                "instead of exiting"
            ) from e


class _LazyEntryPoint:
    """Defers importing a plug-in until it is used."""

    def __init__(self, ep: Any) -> None:
        self.ep = ep

    def load(self) -> Callable[..., Any]:
        return self.ep.load()


rewards = Registry("reward", "omni_diffusion_rl.rewards")
algorithms = Registry("algorithm", "omni_diffusion_rl.algorithms")
teachers = Registry("teacher", "omni_diffusion_rl.teachers")
models = Registry("model", "omni_diffusion_rl.models")
# What a model family adds to evaluation: an answering family's held-out evaluation (a class made
# with (cfg, policy, reward, eval_prompts) that has evaluate() and preview(folder, shown)), and a
# generating family's own render of a prompt shown beside its samples (prompts, generator) -> a tuple
# whose first item is video [B, F, 3, H, W], or None.
evaluations = Registry("held-out evaluation", "omni_diffusion_rl.evaluations")
preview_references = Registry("preview reference", "omni_diffusion_rl.preview_references")
# What an answering run's prompts name when they are not a question file's keys (data.questions): a
# class made with no arguments that has ask(prompt, generator) -> AskedQuestion (answer_data/) and
# text(prompt) -> str (the question alone, nothing rendered). Tiny AVQA is one.
question_sets = Registry("question set", "omni_diffusion_rl.question_sets")
