"""The config loader fuzzed (issue 24, item 5): arbitrary YAML texts and override strings either load
or raise ConfigError, quickly: never a RecursionError, never a hang, and what loads is no larger than
what was written (so a config can always be copied, compared and written into a checkpoint).

Shown by mutation to find what it guards against (config.py edited in a copy of the repository, this
file run there, the edit undone):
- the alias refusal removed from `_Loader.compose_node`: alias bombs (at most 5^6 values, small
  enough not to hang) load, and `test_yaml_texts_load_or_refuse` and `test_overrides_load_or_refuse`
  fail on the size bound (a few hundred bytes become thousands of values);
- the depth bound removed from `_Loader.compose_node`: deep flow and block nesting raise
  RecursionError, and both tests fail;
- `_check_depth` removed from `config_from_dict`: a dotted override key of thousands of parts loads
  and `dataclasses.asdict` raises RecursionError; `test_overrides_load_or_refuse` fails.

These are entries of tests/tools/mutations.py: re-run with
`python -m tests.tools.mutations --only 'config-*'` (`--list` shows which test claims which). It finds
the first claim for `test_overrides_load_or_refuse` no longer holds: its entry
config-aliases-allowed-overrides is a known gap.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from omni_diffusion_rl.config import ConfigError, ExperimentConfig, load_config

SECONDS = 20  # per example, a hang's bound (a refused bomb takes milliseconds)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    database=None,  # nothing written into the repository
    derandomize=True,  # the same examples on every run: CI stays reproducible
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Real sections and keys (so that many examples load) and others; never reward.plugins (it imports).
KEYS = {
    "model": ["family", "pretrained", "lora_rank", "options"],
    "algorithm": ["name", "beta", "adv_mode", "options"],
    "reward": ["weights", "options", "url"],
    "train": ["steps", "seed", "output_dir"],
    "data": ["group_size", "prompts_per_step"],
    "teacher": ["name", "urls", "options"],
    "eval": ["metrics", "options"],
    "nope": ["x"],
}
OPTIONS = ["model.options", "algorithm.options", "reward.options", "teacher.options"]
WORDS = [
    *"a x lol policy distill euler tiny_av color_match 1e-4 .inf -.nan ~ yes no null 2024-02-30".split(),
    *"0x1F 0o17 1_000 12:30:05 'q' -1 3 0.5 *a *b << =".split(),
    *['"d\\x41"', "!!int x", "!!binary '%%'", "!!set {a}", "&a 1", "9" * 5000],  # tags, a long number
]
NAMES = st.sampled_from(["a", "b", "c", "lr", "x", "1", "true", "null", "<<", "'k'", "? a", "a a"])
PUNCTUATION = list(":-[]{}&*!|>'\"#,?%@` \n\t")


def _flow(inner: st.SearchStrategy[str]) -> st.SearchStrategy[str]:
    """Flow collections of `inner` values, sometimes anchored."""
    lists = st.lists(inner, max_size=4).map(lambda items: "[" + ", ".join(items) + "]")
    maps = st.lists(st.tuples(NAMES, inner), max_size=4).map(
        lambda pairs: "{" + ", ".join(f"{k}: {v}" for k, v in pairs) + "}"
    )
    return st.tuples(st.sampled_from(["", "", "&a ", "&b "]), lists | maps).map("".join)


VALUES = st.recursive(st.sampled_from(WORDS) | st.integers().map(str), _flow, max_leaves=12)


@st.composite
def documents(draw: st.DrawFn) -> str:
    """A block-style config of real and unknown keys, its text sometimes spoiled by punctuation."""
    sections = draw(st.lists(st.sampled_from(sorted(KEYS)), max_size=4))
    text = "".join(
        f"{section}:\n"
        + "".join(f"  {key}: {draw(VALUES)}\n" for key in draw(st.lists(st.sampled_from(KEYS[section]))))
        for section in sections
    )
    for position, char in draw(
        st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(PUNCTUATION)), max_size=3)
    ):
        at = position % (len(text) + 1)
        text = text[:at] + char + text[at:]
    return text


@st.composite
def bombs(draw: st.DrawFn) -> str:
    """A flow mapping whose aliases nest: width^levels values (at most 5^6, quick even if loaded)."""
    levels, width = draw(st.integers(3, 6)), draw(st.integers(3, 5))
    names = [chr(ord("a") + i) for i in range(levels)]
    entries = [f"{names[0]}: &{names[0]} [{', '.join(['lol'] * width)}]"]
    entries += [
        f"{names[i]}: &{names[i]} [{', '.join([f'*{names[i - 1]}'] * width)}]" for i in range(1, levels)
    ]
    return "{" + ", ".join(entries) + "}"


@st.composite
def deep_values(draw: st.DrawFn) -> str:
    """A flow value nested up to 3000 levels (Python's recursion limit is 1000 frames)."""
    depth = draw(st.integers(1, 3000))
    if draw(st.booleans()):
        return "[" * depth + "]" * depth
    return "{a: " * depth + "1" + "}" * depth


def _under(key: str, value: str) -> str:
    """`value` as the block YAML of the dotted `key`."""
    section, name = key.split(".")
    return f"{section}:\n  {name}: {value}\n"


def _deep_block(depth: int) -> str:
    return "".join(f"{'  ' * i}k:\n" for i in range(depth))


TEXTS = st.one_of(
    documents(),
    st.text(st.sampled_from([*PUNCTUATION, *"ab1.e~"]), max_size=120),
    st.tuples(st.sampled_from(OPTIONS), bombs()).map(lambda kv: _under(*kv)),
    st.tuples(st.sampled_from(OPTIONS), deep_values()).map(lambda kv: _under(*kv)),
    st.integers(1, 3000).map(_deep_block),
)
DOTTED = st.sampled_from([f"{s}.{k}" for s, keys in KEYS.items() for k in keys])
LONG_KEYS = st.integers(1, 5000).map(lambda n: "model.options." + ".".join(["a"] * n))
OVERRIDES = st.one_of(
    st.tuples(DOTTED, VALUES | bombs() | deep_values()).map("=".join),
    LONG_KEYS.map(lambda key: f"{key}=1"),
    st.text(st.sampled_from([*PUNCTUATION, *"ab1.=~"]), max_size=60),
)


@contextmanager
def _bounded(seconds: int) -> Iterator[None]:
    """Fail (rather than hang CI) when the body runs longer than `seconds`."""

    def expired(*_: object) -> None:
        raise TimeoutError(f"loading took over {seconds} s: a hang")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _values(data: Any) -> int:
    """Values in nested mappings and lists, containers included (iteratively)."""
    count, stack = 0, [data]
    while stack:
        value = stack.pop()
        count += 1
        if isinstance(value, dict):
            stack += value.values()
        elif isinstance(value, list):
            stack += value
    return count


DEFAULT_VALUES = _values(ExperimentConfig().to_dict())


def _loads_or_refuses(path: Path | None, overrides: list[str]) -> None:
    """load_config gives a config no larger than its input, or a ConfigError, within SECONDS."""
    written = (len(path.read_text()) if path else 0) + sum(len(o) for o in overrides)
    with _bounded(SECONDS):
        try:
            cfg = load_config(path, overrides)
        except ConfigError:
            event("refused")
            return
        event("loaded")
        data = cfg.to_dict()
        json.dumps(data)  # it can be written into a checkpoint's state.json
    assert _values(data) <= DEFAULT_VALUES + written, "a few bytes became many values"


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "config.yaml"


@FUZZ
@given(text=TEXTS)
def test_yaml_texts_load_or_refuse(config_file: Path, text: str) -> None:
    config_file.write_text(text, encoding="utf-8")
    _loads_or_refuses(config_file, [])


@FUZZ
@given(overrides=st.lists(OVERRIDES, min_size=1, max_size=3))
def test_overrides_load_or_refuse(overrides: list[str]) -> None:
    _loads_or_refuses(None, overrides)
