"""Fuzzing the checkpoint loader (GitHub issue 24): a real small checkpoint's manifest, state.json,
training state and safetensors headers are mutated (by structure and byte by byte; the manifest is
rehashed as a forger would), and loading it the ways the commands do must either succeed with
checked values or raise CheckpointError, never another exception.

Each test was shown to fail with the checks it guards removed (its docstring names the mutations):
each mutation re-made the checked function from its edited source in memory, before the test
module was imported, so the files were never changed. tests/tools/mutations.py holds them as exact
edits made in a copy of the repository instead, each claimed test run there: re-run with
`python -m tests.tools.mutations --only 'checkpoint-*'` (`--list` shows which test claims which).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import struct
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from omni_diffusion_rl.checkpoint import (
    MANIFEST,
    MAX_LORA_RANK,
    MAX_SAMPLING_STEPS,
    MAX_STEP,
    CheckpointError,
    load_checkpoint,
)
from omni_diffusion_rl.config import DataConfig, RewardConfig
from omni_diffusion_rl.evaluation.targets import target_config
from omni_diffusion_rl.inference import load_policy
from omni_diffusion_rl.models import lora
from omni_diffusion_rl.trainers.trainer import Trainer

from .helpers import tiny_model_dir
from .test_checkpoint_trust import keep_rng, rehash, saved_tiny_run  # noqa: F401 - keep_rng: a fixture

pytestmark = pytest.mark.usefixtures("single_thread")
FUZZ = settings(
    max_examples=20,
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

# ------------------------------------------------------------------------------------ strategies
RAW = {'"__DEEP__"': "[" * 5000 + "]" * 5000, '"__HUGE_INT__"': "1" * 5000}
"""Placeholders replaced in the serialized text: what json.dumps cannot write."""
HOSTILE = ["__DEEP__", "__HUGE_INT__", None, True, -1, 0, 2**31, 10**12, 1.5, math.nan, math.inf]
HOSTILE += ["", "abc", "a" * 5000, "\x00", [], [1, "x"], {}, {"a": [None]}]
"""Values that break a field of any type: nesting past any bound, numbers past any range, wrong types."""
JSON = st.recursive(  # any JSON value, HOSTILE ones among them
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12) | st.sampled_from(HOSTILE),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
TOKENS = st.sampled_from(
    ["[" * 5000, "{" * 5000, '{"a":' * 3000, "[" * 200_000, "1" * 5000, "1e999", "NaN", "-Infinity"]
    + ["\\ud800", "\ud800", "\x00", '"', "\\", "{", "}", "[", "]", ",", ":", "null", "true", "-", "0x10"]
)


@st.composite
def text_mutations(draw: st.DrawFn, text: str) -> bytes:
    """`text` with a few splices: a token put in front or inside, a character replaced, a span
    deleted, the end cut off; encoded so that a lone surrogate becomes invalid UTF-8."""
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.integers(0, len(text)))
        op = draw(st.sampled_from(["prefix", "insert", "replace", "delete", "truncate"]))
        if op == "prefix":
            text = draw(TOKENS) + text
        elif op == "insert":
            text = text[:at] + draw(TOKENS) + text[at:]
        elif op == "replace" and at < len(text):
            text = text[:at] + draw(st.characters()) + text[at + 1 :]
        elif op == "delete":
            text = text[:at] + text[at + draw(st.integers(1, 40)) :]
        else:
            text = text[:at]
    return text.encode("utf-8", "surrogatepass")


def _set(tree: Any, path: tuple[Any, ...], value: Any, delete: bool) -> Any:
    """`tree` with the item at `path` (keys of dicts, indexes of lists) replaced or deleted; a
    missing step of the path is created as a dict."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(tree, list) and isinstance(head, int) and 0 <= head < len(tree):
        if delete and not rest:
            return tree[:head] + tree[head + 1 :]
        return [*tree[:head], _set(tree[head], rest, value, delete), *tree[head + 1 :]]
    tree = dict(tree) if isinstance(tree, dict) else {}
    if delete and not rest:
        tree.pop(head, None)
    else:
        tree[head] = _set(tree.get(head), rest, value, delete)
    return tree


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path into a JSON tree (the root included)."""
    found = [prefix]
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else []
    for key, value in items:
        found += _paths(value, (*prefix, key))
    return found


def _serialized(tree: Any) -> bytes:
    text = json.dumps(tree)
    for placeholder, raw in RAW.items():
        text = text.replace(placeholder, raw)
    return text.encode("utf-8", "surrogatepass")


ANYWHERE = None
"""The parameter of a fuzz test that mutates any item of the file, or splices its text."""


@st.composite
def json_mutations(draw: st.DrawFn, tree: Any, path: tuple[Any, ...] | None, breakers: list[Any]) -> bytes:
    """The JSON `tree` with the item at `path` replaced (by one of `breakers`, a HOSTILE value or any
    JSON value) or, one time in four, deleted; with `path` ANYWHERE, any item replaced by any JSON
    value, or the text spliced (text_mutations)."""
    if path is ANYWHERE:
        if draw(st.booleans()):
            return draw(text_mutations(json.dumps(tree)))
        path, breakers = draw(st.sampled_from(_paths(tree))), []
    value = draw(st.one_of(st.sampled_from(breakers or HOSTILE), st.sampled_from(HOSTILE), JSON))
    return _serialized(_set(tree, path, value, delete=draw(st.integers(0, 3)) == 0))


MANIFEST_TARGETS: dict[tuple[Any, ...], list[Any]] = {
    (): [[], "files", 1],
    ("files",): [1, 2.5, True, "x", [], [["state.json"]]],
    ("files", "../x"): [{"bytes": 1, "sha256": "0" * 64}],
    ("files", "state.json"): [1, "x", {"bytes": "1"}, {"bytes": 1, "sha256": 3}],
    ("files", "state.json", "bytes"): [-1, "1", True, 2**70],
    ("files", "tensors.safetensors", "sha256"): [3, "0" * 64, "Z" * 64],
    ("step",): ["abc", -1],
}
MODEL = ("config", "model")
SAMPLING = ("config", "sampling")
MODEL_TARGETS: dict[tuple[Any, ...], list[Any]] = {
    ("config",): [[], "x", 1, None],
    MODEL: [[], "x", 1, None, {"family": "tiny_av"}],
    (*MODEL, "lora_rank"): [513, 10**7, 2**31, 2**40, "abc", 0, 8],
    (*MODEL, "lora_alpha"): [-1, 1e308, "x", 8],
    (*MODEL, "pretrained"): [
        "/etc/passwd",
        "README.md",
        "tests/helpers.py",
        "http://127.0.0.1:1/x",
        "../x",
        "a/b",
    ],
    (*MODEL, "family"): ["nope", "tiny_omni", "sd3", 3],
    (*MODEL, "lora_targets"): [["nope"], "to_q", [""], [1], ["x"] * 300],
    (*MODEL, "options"): [{"height": 10**12}, {"h": [1]}, {"h": {"x": 1}}, {"vae_tiling": True}],
    (*MODEL, "base_dtype"): ["bf16", "fp8"],
    (*MODEL, "gradient_checkpointing"): [True, "yes"],
    SAMPLING: [[], "x", None],
    (*SAMPLING, "eval_num_steps"): [1001, 10**12, "x", 3.5],
    (*SAMPLING, "num_steps"): [1001, 10**12, "x"],
    (*SAMPLING, "solver"): ["heun", "rk4"],
    (*SAMPLING, "time_shift"): [1e308, "x"],
    ("model_fingerprint",): ["zz", "0" * 65, 7],
}
"""What sample, eval and export read from state.json, and values that break each."""
RESUME_TARGETS: dict[tuple[Any, ...], list[Any]] = {
    (): [[], 1],
    ("step",): ["abc", 10**10, 1.5, 2],
    ("format",): [1, 3, "2"],
    ("eval_before",): [{"r": [1]}, {"r": "x"}, {"r": math.nan}, {"r": 0.5}],
    ("sample_counts",): [[1, 2], {"t": "x"}, {"t": 2**60}, {"t": 3}],
    ("wandb_run_id",): ["../x", "a" * 65, "run-1"],
    ("execution",): [{"buffer": 1}, {"stream_next": -1}],
}
"""What --resume reads from state.json besides the model, and values that break each."""
OPTIMIZER, ENTRY = ("optimizer",), ("optimizer", "state", "__dict__", 0)
GROUP, NUMPY = ("optimizer", "param_groups", 0), ("numpy_rng", "__tuple__")
TRAINING_TARGETS: dict[tuple[Any, ...], list[Any]] = {
    (): [[], {}],
    OPTIMIZER: [{"state": {}}],
    (*OPTIMIZER, "state"): [[], {"__dict__": [[99, {}]]}],
    (*OPTIMIZER, "param_groups"): [[{}], []],
    (*GROUP, "params"): [[[], 1], [0, 0], list(range(99))],
    (*GROUP, "lr"): [-1.0, "x"],
    (*GROUP, "betas"): [{"__tuple__": [0.9]}, [0.9, 0.99]],
    (*GROUP, "amsgrad"): [True],
    (*GROUP, "unknown"): [1],
    (*ENTRY, 0): [99, "x"],
    (*ENTRY, 1): [{"exp_avg": {"__tensor__": "state.optimizer.state.0.exp_avg"}}, {"step": 1}, {}],
    (*ENTRY, 1, "step"): [{"__tensor__": "state.torch_rng"}, 1],
    (*ENTRY, 1, "exp_avg"): [{"__tensor__": "state.torch_rng"}, {"__tensor__": "nope"}, 0.5],
    ("torch_rng",): [[1], {"__tensor__": "nope"}],
    ("python_rng",): [{"__tuple__": [3, {"__tuple__": [-1] * 625}, None]}, {"__tuple__": [2]}],
    ("python_rng", "__tuple__", 1, "__tuple__", 0): [-1, 2**32, 1.5],
    ("python_rng", "__tuple__", 1, "__tuple__", 624): [625, 10**6],
    (*NUMPY, 0): ["PCG64", 1],
    (*NUMPY, 1, "dtype"): ["<x9", "O", "<f8", "|b1", 3],
    (*NUMPY, 2): [-1, 625, "x"],
    (*NUMPY, 4): ["x", math.nan],
}
"""What --resume reads from training_state.json, and values that break each."""


SAFETENSORS_DTYPES = ["F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"]
SAFETENSORS_DTYPES += ["BOOL", "F8_E4M3", "F8_E5M2", "F8_E8M0", "C64", "F4", "X"]


SAFETENSORS_OPS = ("dtype", "shape", "offsets", "rename", "add", "drop", "length", "header bytes", "poison")
NON_FINITE = (b"\xff\xff\xff\x7f", b"\x00\x00\x80\x7f", b"\x00\x00\x80\xff")
"""float32 NaN, +inf and -inf, little-endian."""


@st.composite
def safetensors_mutations(draw: st.DrawFn, data: bytes, op: str) -> bytes:
    """A safetensors file edited by `op`: a tensor's dtype, shape or offsets changed, a tensor renamed,
    added or dropped, the header's length field changed, header bytes overwritten, or a float32 of
    the data set to NaN or an infinity."""
    (length,) = struct.unpack("<Q", data[:8])
    header, body = json.loads(data[8 : 8 + length]), data[8 + length :]
    name = draw(st.sampled_from(sorted(k for k in header if k != "__metadata__")))
    entry = dict(header[name])
    if op == "header bytes":
        raw = bytearray(data[8 : 8 + length])
        for _ in range(draw(st.integers(1, 4))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        return data[:8] + bytes(raw) + body
    if op == "length":
        return struct.pack("<Q", draw(st.integers(0, 2**64 - 1))) + data[8:]
    if op == "poison":
        at = draw(st.integers(0, len(body) // 4 - 1)) * 4
        return data[: 8 + length] + body[:at] + draw(st.sampled_from(NON_FINITE)) + body[at + 4 :]
    if op == "dtype":
        entry["dtype"] = draw(st.sampled_from(SAFETENSORS_DTYPES))
    elif op == "shape":
        entry["shape"] = draw(st.lists(st.integers(-2, 2**40), max_size=3))
    elif op == "offsets":
        entry["data_offsets"] = draw(st.lists(st.integers(-1, len(body) + 8), min_size=2, max_size=2))
    elif op == "rename":
        new = draw(st.sampled_from(["", "extra", "default/x", name + "x", "old/" + name, "__metadata__"]))
        header[new] = header.pop(name)
    elif op == "drop":
        header.pop(name)
    if op in ("dtype", "shape", "offsets", "add"):
        header[name if op != "add" else name + ".extra"] = entry
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + body


# ------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory) -> Trainer:
    """A tiny run that saved step 1: its checkpoint is the one mutated, and --resume loads into it."""
    root = tmp_path_factory.mktemp("fuzz")
    return saved_tiny_run(tiny_model_dir(root / "model"), root / "run")


@pytest.fixture(scope="module")
def original(trainer: Trainer) -> Path:
    return trainer.output_dir / "checkpoints" / "step_0000001"


@contextmanager
def forged(original: Path, name: str, data: bytes, rehashed: bool = True) -> Iterator[Path]:
    """A copy of the checkpoint with `name` replaced by `data` (and the manifest rehashed)."""
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(shutil.copytree(original, Path(tmp) / "step_0000001"))
        (folder / name).write_bytes(data)
        if rehashed:
            rehash(folder)
        yield folder


def loads_or_refuses(load: Callable[[], Any]) -> Any:
    """`load()`'s result, or None when it raised CheckpointError; any other exception fails."""
    try:
        return load()
    except CheckpointError:
        return None


def _snapshot(trainer: Trainer) -> list[Any]:
    """What a resume changes: the step and counters, the adapters, the optimizer's moments, the RNGs."""
    moments = [v for entry in trainer.optimizer.state.values() for v in entry.values()]
    tensors = [*lora.nft_adapter_tensors(trainer.transformer).values(), *moments, torch.get_rng_state()]
    plain = [trainer.step, dict(trainer.sample_counts), repr(trainer.eval_before), random.getstate()]
    return [t.clone() for t in tensors] + plain + [repr(np.random.get_state())]


def _same(a: list[Any], b: list[Any]) -> bool:
    pairs = zip(a, b, strict=False)
    return len(a) == len(b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in pairs
    )


@torch.no_grad()
def _unlike_the_checkpoint(trainer: Trainer) -> None:
    """Move the run away from what the checkpoint holds (adapters, optimizer moments, step, RNGs), so
    that a partly applied refusal shows."""
    for param in lora.adapter_parameters(trainer.transformer, lora.TRAINED).values():
        param.add_(1.0)
    trainer.optimizer.state.clear()
    trainer.step = 12345
    torch.manual_seed(12345)
    random.seed(12345)
    np.random.seed(12345)


def resumes_or_refuses(trainer: Trainer, folder: Path) -> None:
    """trainer.load(folder) applies checked values, or raises CheckpointError having changed nothing."""
    _unlike_the_checkpoint(trainer)
    before = _snapshot(trainer)
    try:
        trainer.load(folder)
    except CheckpointError:
        assert _same(_snapshot(trainer), before), "a refused checkpoint changed the run"
        return
    assert isinstance(trainer.step, int) and 0 <= trainer.step <= MAX_STEP
    assert all(set(trainer.optimizer.defaults) <= set(group) for group in trainer.optimizer.param_groups)
    assert all(isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in trainer.sample_counts.items())
    assert all(
        torch.isfinite(p).all() for p in lora.adapter_parameters(trainer.transformer, lora.TRAINED).values()
    )


def _check_sampled(policy: Any, folder: Path) -> None:
    """A sampled policy has finite float32 adapters, loaded from floating tensors only."""
    from safetensors import safe_open

    for name in (lora.TRAINED, lora.OLD):
        params = lora.adapter_parameters(policy.transformer, name).values()
        assert all(p.dtype == torch.float32 and torch.isfinite(p).all() for p in params)
    with safe_open(str(folder / "tensors.safetensors"), "pt") as f:
        assert all(f.get_slice(k).get_dtype() in ("F16", "BF16", "F32", "F64") for k in f.keys())


def _check_evaluated(cfg: Any) -> None:
    """The trust boundary: whatever the checkpoint says, eval's reward, data and metrics are this
    package's defaults for the model's family (no --config was given): no server, token variable,
    prompt file, plug-in or options of the checkpoint's."""
    reward, data = RewardConfig(), DataConfig()
    assert (cfg.reward.url, cfg.reward.token_env, cfg.reward.plugins) == (reward.url, reward.token_env, [])
    assert cfg.reward.options == {} and cfg.eval.options == {} and cfg.data.prompts == data.prompts
    assert cfg.data.eval_prompts in (data.eval_prompts, "builtin:tiny_avqa_heldout")
    assert not Path(cfg.model.pretrained).is_file()  # the base is a model, never a file to read
    assert cfg.model.lora_rank <= MAX_LORA_RANK
    assert cfg.sampling.eval_num_steps <= MAX_SAMPLING_STEPS and cfg.sampling.num_steps <= MAX_SAMPLING_STEPS


# ------------------------------------------------------------------------------------ the fuzz tests
def _cases(targets: dict[tuple[Any, ...], list[Any]]) -> Any:
    """pytest parameters: each targeted path with its breakers, and ANYWHERE."""
    cases = [
        pytest.param(path, values, id="/".join(map(str, path)) or "root") for path, values in targets.items()
    ]
    return [*cases, pytest.param(ANYWHERE, [], id="anywhere")]


def _mutated(original: Path, name: str, data: st.DataObject, path: Any, breakers: list[Any]) -> bytes:
    tree = json.loads((original / name).read_text(encoding="utf-8"))
    return data.draw(json_mutations(tree, path, breakers))


@pytest.mark.parametrize(("path", "breakers"), _cases(MANIFEST_TARGETS))
@FUZZ
@given(data=st.data())
def test_fuzzed_manifest_loads_or_is_refused(
    original: Path, path: Any, breakers: list[Any], data: st.DataObject
) -> None:
    """manifest.json mutated (its file table, entries, sizes, hashes, names; anywhere; its text
    spliced): load_checkpoint, with and without the training state, loads or raises CheckpointError.

    Mutations it fails on: `nesting_exceeds` always False (RecursionError in json.loads);
    read_json catching json.JSONDecodeError instead of ValueError (a 5000-digit integer's
    ValueError); _verified_manifest's `isinstance(files, dict)` weakened to `files is None`
    (TypeError: an int has no len())."""
    with forged(
        original, MANIFEST, _mutated(original, MANIFEST, data, path, breakers), rehashed=False
    ) as folder:
        for objects in (False, True):
            got = loads_or_refuses(lambda objects=objects: load_checkpoint(folder, objects=objects))
            assert got is None or got[2]["step"] == 1


@pytest.mark.slow
@pytest.mark.parametrize(("path", "breakers"), _cases(MODEL_TARGETS))
@FUZZ
@given(data=st.data())
def test_fuzzed_model_section_loads_or_is_refused(
    original: Path, trainer: Trainer, path: Any, breakers: list[Any], data: st.DataObject
) -> None:
    """state.json's model and sampling sections mutated (anywhere too; its text spliced) and
    rehashed: eval (target_config), sample (load_policy) and --resume (Trainer.load) each load with
    checked values or raise CheckpointError, and eval's reward and data never come from the
    checkpoint.

    Mutations it fails on: _config_section without `_table(config, ...)` (AttributeError: a list
    config has no get); checkpoint_model without the MAX_LORA_RANK cap (rank 513 reaches eval);
    check_pretrained without `local.exists()` (README.md, a file, becomes the base)."""
    with forged(original, "state.json", _mutated(original, "state.json", data, path, breakers)) as folder:
        cfg = loads_or_refuses(lambda: target_config(str(folder), None, []))
        if cfg is not None:
            _check_evaluated(cfg)  # first: a rank over the cap is never built
        policy = loads_or_refuses(lambda: load_policy(folder))
        if policy is not None:
            _check_sampled(policy, folder)
        resumes_or_refuses(trainer, folder)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "breakers"), _cases(RESUME_TARGETS))
@FUZZ
@given(data=st.data())
def test_fuzzed_resume_fields_load_or_are_refused(
    original: Path, trainer: Trainer, path: Any, breakers: list[Any], data: st.DataObject
) -> None:
    """state.json's step, format, counters, held-out result, run id and buffer section mutated
    (anywhere too; its text spliced) and rehashed: --resume loads checked values or raises
    CheckpointError having changed nothing.

    Mutations it fails on: checkpoint_step without its range check (step "abc" is resumed);
    resume_fields without `_table(sample_counts, ...)` (AttributeError: a list has no items)."""
    with forged(original, "state.json", _mutated(original, "state.json", data, path, breakers)) as folder:
        resumes_or_refuses(trainer, folder)


@pytest.mark.slow
@pytest.mark.parametrize(("path", "breakers"), _cases(TRAINING_TARGETS))
@FUZZ
@given(data=st.data())
def test_fuzzed_training_state_loads_or_is_refused(
    original: Path, trainer: Trainer, path: Any, breakers: list[Any], data: st.DataObject
) -> None:
    """training_state.json mutated (the optimizer's groups and states, the RNG states, numpy dtypes,
    tags; anywhere; its text spliced) and rehashed: --resume loads or raises CheckpointError having
    changed nothing.

    Mutations it fails on: _check_python_rng accepting anything (random.setstate fails after the
    adapters and torch's RNG were applied: a refusal that changed the run); _check_param_state
    without its key-set check (Adam's KeyError 'step' after a partial optimizer load);
    _check_param_group without the needed settings (KeyError 'params'); _decoded_training_state
    catching only StateCodecError (numpy's TypeError for dtype '<x9')."""
    name = "training_state.json"
    with forged(original, name, _mutated(original, name, data, path, breakers)) as folder:
        resumes_or_refuses(trainer, folder)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tensors.safetensors", "training_state.safetensors"])
@pytest.mark.parametrize("op", SAFETENSORS_OPS)
@FUZZ
@given(data=st.data())
def test_fuzzed_safetensors_header_loads_or_is_refused(
    original: Path, trainer: Trainer, name: str, op: str, data: st.DataObject
) -> None:
    """A safetensors file mutated (its header's dtypes, shapes, offsets, names, length field and
    bytes; a value set to NaN or an infinity) and rehashed: sample (load_policy) and --resume load
    finite floating tensors or raise CheckpointError.

    Mutations it fails on: _load_tensors without `except SafetensorError` (the header's error
    escapes); check_adapter_tensors without the ADAPTER_DTYPES check (I32 bytes are loaded as an
    adapter); check_adapter_tensors without the finite check (a NaN adapter is loaded)."""
    mutated = data.draw(safetensors_mutations((original / name).read_bytes(), op))
    with forged(original, name, mutated) as folder:
        if name == "tensors.safetensors":
            policy = loads_or_refuses(lambda: load_policy(folder))
            if policy is not None:
                _check_sampled(policy, folder)
        resumes_or_refuses(trainer, folder)
