"""Config files and overrides as plain data: YAML read by a bounded loader (no aliases, tags,
duplicate keys or deep nesting), files checked and size-bounded, `section.key=value` overrides.
config.py builds the typed config from what this reads."""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import yaml

from .config_fields import ConfigError

MAX_DEPTH = 32
"""Nesting levels a config may have, scalars included (`train: {steps: 3}` has 3; recipes have 4)."""
_MERGE_TAG, _TIMESTAMP_TAG = "tag:yaml.org,2002:merge", "tag:yaml.org,2002:timestamp"


class _Refused(yaml.MarkedYAMLError):
    """Well-formed YAML a config may not hold: an alias, a tag, a duplicate key, deep nesting."""


class _Loader(yaml.SafeLoader):
    """The safe loader, bounded: what a config can become is no larger than its text. Refused: aliases
    (nested ones expand a few hundred bytes into billions of values when the config is copied),
    explicit tags, duplicate keys (the last one would win silently) and nesting past MAX_DEPTH (which
    would exhaust Python's recursion). Dates stay text; 1e-4 (no dot, text in YAML 1.1) is a number,
    as learning rates are written that way."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            self._refuse(
                f"the alias *{event.anchor} is refused (aliases can expand a few bytes into "
                "billions of values); write the value out",
                event,
            )
        if getattr(event, "tag", None) is not None:
            tag = str(event.tag).replace("tag:yaml.org,2002:", "!!")
            self._refuse(
                f"the tag {tag} is refused; a config holds text, numbers, true/false, "
                "null, lists and mappings (quote a value to make it text)",
                event,
            )
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                self._refuse(f"nesting deeper than {MAX_DEPTH} levels is refused", event)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, yaml.Mark] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                mark = first.setdefault(key, key_node.start_mark)
            except TypeError:  # an unhashable key: the base class refuses it
                continue
            if mark is not key_node.start_mark:
                self._refuse(
                    f"the key {key!r} is given twice (first on line {mark.line + 1}); give each key once",
                    key_node,
                )
        return super().construct_mapping(node, deep=deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep=deep)
        except (ValueError, OverflowError) as e:  # a number too long for int(), ...
            self._refuse(f"cannot read {str(node.value)[:60]!r} ({e})", node)

    @staticmethod
    def _refuse(problem: str, where: yaml.Event | yaml.Node) -> typing.NoReturn:
        raise _Refused(problem=problem, problem_mark=where.start_mark)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)
_Loader.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != _TIMESTAMP_TAG]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def _yaml(text: str, where: str = "the YAML") -> Any:
    """`text` read by the bounded loader, or a ConfigError that starts with `where`."""
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except _Refused as e:
        raise ConfigError(f"{where}, line {e.problem_mark.line + 1}: {e.problem}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"{where} is not valid YAML: {_yaml_problem(e)}") from e


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what is wrong and where (PyYAML's own text spans several lines)."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return "; ".join(part for part in (e.context, e.problem) if part) + at
    return " ".join(str(e).split())


def _shown(text: str, limit: int = 80) -> str:
    """`text` as an error quotes it: cut to `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _check_depth(data: Any) -> None:
    """Refuse data nested deeper than MAX_DEPTH (from any source: YAML, overrides, a checkpoint's
    JSON); iterative, so no depth can exhaust the recursion limit."""
    stack: list[tuple[Any, str, int]] = [(data, "", 1)]
    while stack:
        value, key, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(
                f"{_shown(key) or 'config'}: nested deeper than {MAX_DEPTH} levels; a config is a few "
                "levels deep"
            )
        if isinstance(value, dict):
            stack += [(v, f"{key}.{k}" if key else str(k), depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{key}[{i}]", depth + 1) for i, v in enumerate(value)]


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override '{_shown(dotted)}': '{_shown(part)}' is not a section")
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """'algorithm.beta=0.1' -> ('algorithm.beta', 0.1); the value is read as YAML (bounded as files are)."""
    if "=" not in text:
        raise ConfigError(f"override '{_shown(text)}' must look like section.key=value")
    key, raw = text.split("=", 1)
    return key.strip(), _yaml(raw, f"override '{_shown(text)}'") if raw.strip() else ""


MAX_CONFIG_BYTES = 16 << 20


def check_input_file(path: Path, what: str) -> None:
    """A clear ConfigError unless `path` is an existing regular file."""
    if path.is_dir():
        raise ConfigError(f"{what} {path} is a directory; give a file")
    if path.exists() and not path.is_file():
        raise ConfigError(f"{what} {path} is not a regular file (a device, pipe or socket); give a file")
    if not path.is_file():
        raise ConfigError(f"{what} {path} does not exist")


def read_text_bounded(path: Path, limit: int = MAX_CONFIG_BYTES, what: str = "config file") -> str:
    """UTF-8 text of a config-sized file, refusing files over `limit` bytes; a file that cannot be
    read or is not UTF-8 is a ConfigError."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise ConfigError(f"{what} {path} cannot be read ({e.strerror or e})") from e
    if len(data) > limit:
        raise ConfigError(f"{path} is larger than {limit >> 20} MiB; is it really a config?")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"{what} {path} is not UTF-8 text (byte {e.start}: {e.reason}); re-save it as UTF-8"
        ) from e


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The sections of a YAML config file (checked: a regular UTF-8 file holding a mapping, read by
    the bounded loader), or a ConfigError."""
    path = Path(path)
    check_input_file(path, "config file")
    data = _yaml(read_text_bounded(path), f"config file {path}")
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {path} holds a {type(data).__name__}, not a mapping of sections "
            "(e.g. 'train:' with 'steps: 20' under it)"
        )
    return data
