"""Mutation checks: each entry of MUTATIONS edits one product file in a copy of the repository and runs
the tests that claim to catch that edit; each claimed test must fail there (exit code 1).

The copy holds the working tree's tracked files and the untracked ones git does not ignore; the
tests run in it with PYTHONPATH set to it, so they import the copy's packages (checked for each
mutation), never the editable install, and the repository's own files are never changed. Run from
the repository root:

    .venv/bin/python -m tests.tools.mutations [--only NAME,...] [--list] [--output FILE.json]

First each claimed test runs once on the unmutated copy and must pass there (`--no-baseline` skips
this); a mutation whose test does not is an ERROR, not run. Then each claimed test runs in a pytest
of its own (`-x`: it stops at the first failing example), so every claim is checked, not only one
of a mutation's tests. A result is CAUGHT (pytest exit code 1: the test failed), SURVIVED (0: it
passed with the mutation) or ERROR (anything else, e.g. a collection error: the edit broke an import;
a test that errors in its setup rather than failing; a run over --timeout). The script exits 0 only
when every mutation's result matches its `expected`.

To add an entry: `old` must occur exactly once in `path` (else the table is stale and the script
refuses to run), `tests` are pytest node ids or `file::test` selectors, and `expected` stays
"caught" unless the test is known not to catch the edit ("survives (known gap: ...)") or to catch
it on some runs only ("flaky (known gap: ...)": CAUGHT and SURVIVED both match, ERROR does not).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PYTHON = REPO / ".venv" / "bin" / "python"
PACKAGES = ("omni_diffusion_rl", "rewards", "teachers")
CAUGHT, SURVIVED, ERROR = "CAUGHT", "SURVIVED", "ERROR"


@dataclass(frozen=True)
class Mutation:
    """One edit of a product file and the tests that must fail with it."""

    name: str
    path: str  # relative to the repository root
    old: str  # must occur exactly once in `path`
    new: str
    tests: tuple[str, ...]  # pytest node ids or file::test selectors, each run on its own
    why: str  # one line: what the edit removes
    expected: str = "caught"  # or "survives (known gap: ...)", or "flaky (known gap: ...)": either


CKPT = "tests/test_fuzz_checkpoint.py::"
MANIFEST = CKPT + "test_fuzzed_manifest_loads_or_is_refused"
MODEL = CKPT + "test_fuzzed_model_section_loads_or_is_refused"
RESUME = CKPT + "test_fuzzed_resume_fields_load_or_are_refused"
TRAINING = CKPT + "test_fuzzed_training_state_loads_or_is_refused"
SAFETENSORS = CKPT + "test_fuzzed_safetensors_header_loads_or_is_refused"
YAML_TEXTS = "tests/test_fuzz_config.py::test_yaml_texts_load_or_refuse"
OVERRIDES = "tests/test_fuzz_config.py::test_overrides_load_or_refuse"
WIRE = "tests/test_fuzz_wire.py::"
MEDIA_BYTES = WIRE + "test_decode_media_on_arbitrary_bytes_decodes_or_raises_wire_error"
MEDIA_MUTATED = WIRE + "test_decode_media_on_mutated_bodies_decodes_or_raises_wire_error"
MEDIA_LIMITS = WIRE + "test_decode_media_keeps_the_reward_limits"
MEDIA_BUILT = WIRE + "test_decode_media_on_built_headers_decodes_or_raises_wire_error"
STATES_BYTES = WIRE + "test_decode_states_on_arbitrary_bytes_decodes_or_raises_wire_error"
STATES_MUTATED = WIRE + "test_decode_states_on_mutated_bodies_decodes_or_raises_wire_error"
STATES_BUILT = WIRE + "test_decode_states_on_built_headers_decodes_or_raises_wire_error"

CHECKPOINT_PY = "omni_diffusion_rl/checkpoint.py"
BOUNDED_JSON_PY = "omni_diffusion_rl/bounded_json.py"
CONFIG_PY = "omni_diffusion_rl/config.py"
WIRE_PY = "omni_diffusion_rl/serving/wire.py"
TEACHER_WIRE_PY = "omni_diffusion_rl/serving/teacher_wire.py"

ALIASES = Mutation(
    "config-aliases-allowed",
    CONFIG_PY,
    "        if isinstance(event, yaml.AliasEvent):\n",
    "        if False:\n",
    (YAML_TEXTS,),
    "the alias refusal removed from _Loader.compose_node (alias bombs load: the size bound fails)",
)
FRAME_SIZE = Mutation(
    "wire-no-frame-size",
    WIRE_PY,
    "        if h > limits.frame_height or w > limits.frame_width:\n",
    "        if False:\n",
    (MEDIA_LIMITS, MEDIA_BUILT),
    "the frame size check in check_limits removed (5 x 5 frames for a reward meant for 4 x 4)",
)
MUTATIONS: tuple[Mutation, ...] = (
    # ---------------------------------------------------------------- tests/test_fuzz_checkpoint.py
    Mutation(
        "checkpoint-nesting-never-exceeds",
        BOUNDED_JSON_PY,
        "    return nesting_depth(text, stop_above=limit) > limit\n",
        "    return False\n",
        (MANIFEST,),
        "nesting_exceeds always False: deep JSON reaches json.loads (RecursionError)",
    ),
    Mutation(
        "checkpoint-read-json-decode-error-only",
        CHECKPOINT_PY,
        "    except ValueError as e:  # JSONDecodeError, or an integer too long to convert\n",
        "    except json.JSONDecodeError as e:\n",
        (MANIFEST,),
        "read_json catches json.JSONDecodeError instead of ValueError (a 5000-digit integer's ValueError)",
    ),
    Mutation(
        "checkpoint-manifest-files-not-none",
        CHECKPOINT_PY,
        "    if not isinstance(files, dict):\n",
        "    if files is None:\n",
        (MANIFEST,),
        "_verified_manifest's isinstance(files, dict) weakened to `files is None` (an int has no len())",
    ),
    Mutation(
        "checkpoint-config-section-no-table",
        CHECKPOINT_PY,
        '    _table(config, "config", path)\n',
        "",
        (MODEL,),
        "_config_section without _table(config, ...) (a list config has no get)",
    ),
    Mutation(
        "checkpoint-model-no-rank-cap",
        CONFIG_PY,
        'lora_rank: int = _spec(16, "LoRA rank of both adapters", ge=1, le=MAX_LORA_RANK)',
        'lora_rank: int = _spec(16, "LoRA rank of both adapters", ge=1)',
        (MODEL,),
        "model.lora_rank without its MAX_LORA_RANK bound, which checkpoints share (rank 513 reaches eval)",
    ),
    Mutation(
        "checkpoint-pretrained-no-exists",
        CHECKPOINT_PY,
        "    if local.exists() or not _HUB_ID.fullmatch(pretrained)",
        "    if not _HUB_ID.fullmatch(pretrained)",
        (MODEL,),
        "check_pretrained without local.exists() (README.md, a file, becomes the base)",
    ),
    Mutation(
        "checkpoint-step-no-range",
        CHECKPOINT_PY,
        '    return _int_field(state["step"], "step", path, 0, MAX_STEP)\n',
        '    return state["step"]\n',
        (RESUME,),
        'checkpoint_step without its range check (step "abc" is resumed)',
    ),
    Mutation(
        "checkpoint-sample-counts-no-table",
        CHECKPOINT_PY,
        'counts = _table(state.get("sample_counts", {}), "sample_counts", path)\n',
        'counts = state.get("sample_counts", {})\n',
        (RESUME,),
        "resume_fields without _table(sample_counts, ...) (a list has no items)",
    ),
    Mutation(
        "checkpoint-python-rng-anything",
        CHECKPOINT_PY,
        "        and (value[2] is None or isinstance(value[2], float))\n    )\n",
        "        and (value[2] is None or isinstance(value[2], float))\n    )\n    ok = True\n",
        (TRAINING,),
        "_check_python_rng accepts anything (random.setstate fails after other states were applied)",
    ),
    Mutation(
        "checkpoint-param-state-no-key-set",
        CHECKPOINT_PY,
        "    if sorted(entry) != sorted(layout):\n",
        "    if False:\n",
        (TRAINING,),
        "_check_param_state without its key-set check (Adam's KeyError 'step' after a partial load)",
    ),
    Mutation(
        "checkpoint-param-group-no-needed",
        CHECKPOINT_PY,
        "not needed <= set(group) <= set(mine)",
        "not set(group) <= set(mine)",
        (TRAINING,),
        "_check_param_group without the needed settings (KeyError 'params')",
    ),
    Mutation(
        "checkpoint-training-state-codec-error-only",
        CHECKPOINT_PY,
        "    except (StateCodecError, TypeError, ValueError) as e:",
        "    except StateCodecError as e:",
        (TRAINING,),
        "_decoded_training_state catches only StateCodecError (numpy's TypeError for dtype '<x9')",
    ),
    Mutation(
        "checkpoint-load-tensors-no-safetensor-error",
        CHECKPOINT_PY,
        "    except (SafetensorError, OSError, ValueError) as e:\n",
        "    except (OSError, ValueError) as e:\n",
        (SAFETENSORS,),
        "_load_tensors without `except SafetensorError` (the header's error escapes)",
    ),
    Mutation(
        "checkpoint-adapter-any-dtype",
        "omni_diffusion_rl/models/lora.py",
        "        if not isinstance(value, torch.Tensor) or value.dtype not in ADAPTER_DTYPES:\n",
        "        if not isinstance(value, torch.Tensor):\n",
        (SAFETENSORS,),
        "check_adapter_tensors without the ADAPTER_DTYPES check (I32 bytes are loaded as an adapter)",
    ),
    Mutation(
        "checkpoint-adapter-no-finite",
        "omni_diffusion_rl/models/lora.py",
        "        if not bool(torch.isfinite(value.to(p.dtype)).all()):\n",
        "        if False:\n",
        (SAFETENSORS,),
        "check_adapter_tensors without the finite check (a NaN adapter is loaded)",
    ),
    # ---------------------------------------------------------------- tests/test_fuzz_config.py
    ALIASES,
    replace(
        ALIASES,
        name="config-aliases-allowed-overrides",
        tests=(OVERRIDES,),
        why="the alias refusal removed, as above, against the overrides test (its docstring claims it)",
        expected=(
            "survives (known gap: in its 150 derandomized examples no alias bomb loads: the 2 under "
            "teacher.options, an options key that keeps lists, are refused for another override of their "
            "example, and none is under model.options)"
        ),
    ),
    Mutation(
        "config-no-depth-bound",
        CONFIG_PY,
        "            if self._depth > MAX_DEPTH:\n",
        "            if False:\n",
        (YAML_TEXTS, OVERRIDES),
        "the depth bound removed from _Loader.compose_node (deep nesting raises RecursionError)",
    ),
    Mutation(
        "config-no-check-depth",
        CONFIG_PY,
        "    _check_depth(data)\n",
        "",
        (OVERRIDES,),
        "_check_depth removed from config_from_dict (a long dotted key: RecursionError in asdict)",
    ),
    # ---------------------------------------------------------------- tests/test_fuzz_wire.py
    Mutation(
        "wire-no-short-body",
        WIRE_PY,
        "    if len(prefix) < 8:\n",
        "    if False:\n",
        (MEDIA_BYTES, STATES_BYTES, STATES_MUTATED),
        "the short-body check in header_length removed (a body under 8 bytes: struct.error)",
    ),
    Mutation(
        "wire-no-header-size",
        WIRE_PY,
        "    if size > MAX_HEADER_BYTES:\n",
        "    if False:\n",
        (MEDIA_BUILT, STATES_BUILT),
        "the header-size check in header_length removed (a header of MAX_HEADER_BYTES + 1 is accepted)",
    ),
    Mutation(
        "wire-json-decode-error-only",
        WIRE_PY,
        "    except (ValueError, RecursionError) as e:",
        "    except json.JSONDecodeError as e:",
        (MEDIA_MUTATED, MEDIA_BUILT, STATES_MUTATED, STATES_BUILT),
        "_json catches only JSONDecodeError (UnicodeDecodeError, RecursionError, a long number's ValueError)",
    ),
    Mutation(
        "wire-spec-any-list",
        WIRE_PY,
        "            and _naturals(shape)\n            and _naturals(offsets)\n",
        "            and isinstance(shape, list)\n            and isinstance(offsets, list)\n",
        (MEDIA_BUILT, STATES_BUILT),
        "_spec accepts any list as shape and offsets (a string or null offset: TypeError)",
    ),
    FRAME_SIZE,
    replace(
        FRAME_SIZE,
        name="wire-no-frame-size-mutated-bodies",
        tests=(MEDIA_MUTATED,),
        why="the frame size check removed, as above, against the mutated-bodies test (its docstring says so)",
        expected=(
            "flaky (known gap: survived 1 run of 14; the media bodies' metadata order is safetensors' "
            "Rust HashMap's, new in each process, so the seeded test does not mutate the same bytes each run)"
        ),
    ),
    Mutation(
        "wire-media-no-finite",
        WIRE_PY,
        "    for name, t in tensors.items():\n        check_finite(name, t)\n",
        "",
        (MEDIA_MUTATED, MEDIA_LIMITS),
        "the NaN/inf check (check_finite) removed from decode_media (NaN samples are accepted)",
    ),
    Mutation(
        "wire-no-prompt-length",
        WIRE_PY,
        "    if longest is not None and len(prompts[longest]) > max_chars:\n",
        "    if False:\n",
        (MEDIA_MUTATED, STATES_MUTATED, STATES_BUILT),
        "the prompt length check in read_prompts removed (MAX_PROMPT_CHARS + 1 characters accepted)",
    ),
    Mutation(
        "wire-teacher-no-t-range",
        TEACHER_WIRE_PY,
        "    if bool(((t < 0) | (t > 1)).any()):\n",
        "    if False:\n",
        (STATES_MUTATED, STATES_BUILT),
        "the t-in-[0, 1] check removed from decode_states",
    ),
    Mutation(
        "wire-teacher-no-max-batch",
        TEACHER_WIRE_PY,
        "    if max_batch is not None and batch > max_batch:\n",
        "    if False:\n",
        (STATES_MUTATED, STATES_BUILT),
        "the max-batch check in check_states_header removed (MAX_BATCH + 1 states are accepted)",
    ),
    # The plants of issue 41's weak tests: each test was rewritten to fail on its edit.
    Mutation(
        "gspo-no-log-ratio-cap",
        "omni_diffusion_rl/algorithms/gspo.py",
        "torch.exp(log_w.clamp(max=20.0))",
        "torch.exp(log_w)",
        ("tests/test_gspo.py::test_a_sequence_log_ratio_above_20_is_capped_at_20_for_either_sign",),
        "GSPO's cap on the sequence log-ratio removed (a log-ratio of 100 gives inf)",
    ),
    Mutation(
        "flow-matching-target-flipped",
        "omni_diffusion_rl/algorithms/nft.py",
        "    return _batch_mean(_per_sample_mean((v_pred - (noise - x0)) ** 2), sample_weight)",
        "    return _batch_mean(_per_sample_mean((v_pred - (x0 - noise)) ** 2), sample_weight)",
        (
            "tests/test_algorithms.py::test_flow_matching_loss_matches_hand_computation",
            "tests/test_algorithms.py::test_flow_matching_loss_is_zero_at_the_velocity_of_the_noising_path",
            "tests/test_sampling.py::test_the_flow_matching_loss_is_least_at_the_exact_gaussian_velocity",
        ),
        "flow_matching_loss's target x0 - noise instead of noise - x0 (weighted path)",
    ),
    Mutation(
        "rollout-keeps-old-adapter",
        "omni_diffusion_rl/trainers/skeleton.py",
        "        lora.soft_update_old(learner.transformer, self.old_decay(step))",
        "        pass",
        (
            "tests/test_qwen_omni.py::test_gspo_trains_colocated_on_the_question_file",
            "tests/test_qwen3_omni.py::test_gspo_trains_colocated_on_the_question_file",
        ),
        "the rollout adapter is never updated after a step (colocated GSPO samples with stale weights)",
    ),
    Mutation(
        "rollout-process-ignores-sync",
        "omni_diffusion_rl/execution/rollout_worker.py",
        "            self.experience.load_rollout_state(message.tensors)",
        "            pass",
        ("tests/test_qwen_omni.py::test_gspo_on_the_thinker_runs_in_the_async_modes",),
        "a rollout process keeps its first weights at every sync (its version still advances)",
    ),
    Mutation(
        "answers-truncation-flag-inverted",
        "omni_diffusion_rl/experience/text_sampling.py",
        "    return Answers(tokens[:, :width], answer_mask[:, :width], logp_out[:, :width], ~done)",
        "    return Answers(tokens[:, :width], answer_mask[:, :width], logp_out[:, :width], done)",
        (
            "tests/test_qwen_omni.py::test_behaviour_log_probs_equal_the_recompute_and_the_thinkers_own_forward",
        ),
        "sampled answers flag the finished ones as truncated and the truncated ones as finished",
    ),
    Mutation(
        "learner-skips-optimizer-step",
        "omni_diffusion_rl/trainers/learner.py",
        "        self.optimizer.step()",
        "        pass",
        ("tests/test_trainer_diffusers.py::test_nft_on_a_tiny_sd3_transformer",),
        "the optimizer never steps (NFT on tiny SD3 would still score a reward in [0, 1])",
    ),
    Mutation(
        "prediction-target-one-way",
        "omni_diffusion_rl/benchmarks/common.py",
        "        gaps = [abs(r) for r in ratios] if two_sided else ratios",
        "        gaps = ratios",
        ("tests/test_bench.py::test_a_prediction_far_too_low_misses_its_target",),
        "a prediction held to its target one way only (63% too low is 'met')",
    ),
    Mutation(
        "resume-without-latest-refused",
        CHECKPOINT_PY,
        "    if latest is None and not (path / MANIFEST).is_file():",
        "    if False:",
        (
            "tests/test_checkpoint.py::"
            "test_a_run_killed_before_its_first_latest_pointer_resumes_from_its_newest_complete_checkpoint",
        ),
        "a run's checkpoints/ without a latest pointer is refused though a complete step folder is there",
    ),
    Mutation(
        "plain-process-dies-with-parent",
        "omni_diffusion_rl/runtime/lifeline.py",
        "    global _enabled_for\n    if not started_by_launcher():",
        "    global _enabled_for\n    _set_death_signal(signal.SIGTERM)\n    if not started_by_launcher():",
        ("tests/test_parent_death.py::test_a_process_not_started_by_a_launcher_outlives_its_parent",),
        "every process gets the parent-death signal, launched or not (nohup odrl train & would die)",
    ),
)


class StaleMutation(RuntimeError):
    """A mutation's `old` text is not in its file exactly once: the table no longer fits the code."""


@dataclass
class Run:
    """One claimed test run against one mutation."""

    test: str
    result: str
    returncode: int | None
    seconds: float
    summary: str  # pytest's last line: "1 failed, 3 passed in 9.1s"
    failure: str = ""  # its FAILED line: the test, its parameters and the exception
    tail: str = ""  # the output's end, unless CAUGHT


@dataclass
class Outcome:
    """A mutation's verdict: CAUGHT only when every claimed test failed."""

    name: str
    path: str
    expected: str
    result: str
    matches: bool
    seconds: float
    runs: list[Run] = field(default_factory=list)
    note: str = ""


# ------------------------------------------------------------------------------------ the copy
def repository_files(repo: Path = REPO) -> list[str]:
    """Tracked files and untracked ones git does not ignore (paths relative to `repo`)."""
    names: set[str] = set()
    for extra in ([], ["--others", "--exclude-standard"]):
        out = subprocess.run(
            ["git", "ls-files", "-z", *extra], cwd=repo, check=True, capture_output=True
        ).stdout
        names.update(n for n in out.decode().split("\0") if n)
    return sorted(names)


def snapshot(into: Path, repo: Path = REPO) -> Path:
    """A copy of the working tree's files in `into` (tracked files deleted from it are left out)."""
    for name in repository_files(repo):
        source, target = repo / name, into / name
        if not source.exists() and not source.is_symlink():
            continue
        if source.is_dir() and not source.is_symlink():  # a submodule: its files are not listed
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, target, follow_symlinks=False)
    return into


def checked_source(mutation: Mutation, root: Path) -> str:
    """The text of `mutation.path` under `root`; a StaleMutation unless `old` occurs there exactly once."""
    path = root / mutation.path
    if not path.is_file():
        raise StaleMutation(f"{mutation.name}: {mutation.path} does not exist (the table is stale)")
    text = path.read_text(encoding="utf-8")
    count = text.count(mutation.old)
    if count != 1:
        raise StaleMutation(
            f"{mutation.name}: its `old` text occurs {count} times in {mutation.path}, not exactly once "
            f"(the table is stale): {mutation.old!r}"
        )
    return text


def apply(mutation: Mutation, root: Path) -> None:
    """`mutation` applied to its file under `root` (a StaleMutation when it no longer fits)."""
    text = checked_source(mutation, root)
    (root / mutation.path).write_text(text.replace(mutation.old, mutation.new), encoding="utf-8")


def _env(root: Path) -> dict[str, str]:
    # COLUMNS: pytest's FAILED lines keep the exception's message
    return {**os.environ, "PYTHONPATH": str(root), "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "250"}


def check_imports_from(root: Path, module_path: str) -> str:
    """'' when a child process in `root` finds the packages (and `module_path`'s module) in `root`,
    else what it found instead."""
    modules = list(PACKAGES)
    if module_path.endswith(".py") and module_path.split("/")[0] in PACKAGES:
        modules.append(module_path.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    probe = "import importlib.util, sys\nfor m in sys.argv[1:]:\n print(importlib.util.find_spec(m).origin)"
    done = subprocess.run(
        [str(PYTHON), "-c", probe, *modules], cwd=root, env=_env(root), capture_output=True, text=True
    )
    if done.returncode != 0:
        return f"cannot locate {modules}: {done.stderr.strip()[-500:]}"
    wrong = [o for o in done.stdout.split() if not Path(o).resolve().is_relative_to(root.resolve())]
    return f"imported from outside the copy: {wrong}" if wrong else ""


# ------------------------------------------------------------------------------------ running
def _summary(output: str) -> str:
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def run_test(root: Path, test: str, timeout: float) -> Run:
    """The claimed `test` run once in `root`: CAUGHT when it fails, SURVIVED when it passes."""
    start = time.monotonic()
    command = [str(PYTHON), "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", test]
    try:
        done = subprocess.run(
            command, cwd=root, env=_env(root), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        seconds = time.monotonic() - start
        return Run(test, ERROR, None, seconds, f"timed out after {timeout:g} s", tail=out[-3000:])
    seconds, output = time.monotonic() - start, done.stdout + done.stderr
    summary = _summary(done.stdout)
    if done.returncode == 0:
        result = SURVIVED
    elif done.returncode == 1 and " failed" in summary:
        result = CAUGHT
    else:  # a collection or setup error, no test selected, an internal error: not a verdict
        result = ERROR
    failed = next((line for line in done.stdout.splitlines() if line.startswith("FAILED ")), "")
    tail = "" if result == CAUGHT else output[-3000:]
    return Run(test, result, done.returncode, seconds, summary, failed[:300], tail)


def matches(expected: str, result: str) -> bool:
    """Whether `result` is what `expected` says: caught, survives, or flaky (either, but not ERROR)."""
    if expected.startswith("flaky"):
        return result in (CAUGHT, SURVIVED)
    return (expected == "caught" and result == CAUGHT) or (
        expected.startswith("survives") and result == SURVIVED
    )


def run_baseline(tests: list[str], base: Path, scratch: Path, timeout: float) -> dict[str, Run]:
    """Each test run once on an unmutated copy: it must pass there, or its failures prove nothing."""
    root = scratch / "baseline"
    shutil.copytree(base, root, symlinks=True)
    try:
        return {test: run_test(root, test, timeout) for test in tests}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def run_mutation(
    mutation: Mutation, base: Path, scratch: Path, timeout: float, baseline: dict[str, Run]
) -> Outcome:
    """`mutation` applied to a fresh copy of `base`, and each of its tests run there (ERROR without
    running when one of them does not pass on the unmutated copy)."""
    start = time.monotonic()
    unsound = [t for t in mutation.tests if t in baseline and baseline[t].result != SURVIVED]
    if unsound:
        note = f"fails or errors without the mutation: {', '.join(unsound)}"
        return Outcome(mutation.name, mutation.path, mutation.expected, ERROR, False, 0.0, note=note)
    root = scratch / mutation.name
    shutil.copytree(base, root, symlinks=True)
    try:
        apply(mutation, root)
        problem = check_imports_from(root, mutation.path)
        if problem:
            seconds = time.monotonic() - start
            return Outcome(
                mutation.name, mutation.path, mutation.expected, ERROR, False, seconds, note=problem
            )
        runs = [run_test(root, test, timeout) for test in mutation.tests]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    results = {r.result for r in runs}
    result = ERROR if ERROR in results else SURVIVED if SURVIVED in results else CAUGHT
    seconds = time.monotonic() - start
    verdict = matches(mutation.expected, result)
    return Outcome(mutation.name, mutation.path, mutation.expected, result, verdict, seconds, runs)


def selected(only: str | None) -> list[Mutation]:
    """The mutations named in `only` (comma-separated names or shell patterns), or all of them."""
    if not only:
        return list(MUTATIONS)
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    unknown = [p for p in patterns if not any(fnmatch.fnmatchcase(m.name, p) for m in MUTATIONS)]
    if unknown:
        raise ValueError(f"no mutation is called {', '.join(unknown)}; --list shows them")
    return [m for m in MUTATIONS if any(fnmatch.fnmatchcase(m.name, p) for p in patterns)]


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated mutation names (shell patterns allowed)")
    parser.add_argument("--list", action="store_true", help="print the table and run nothing")
    parser.add_argument("--output", type=Path, default=REPO / "runs" / "bench" / "mutations.json")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per test run (then ERROR)")
    parser.add_argument(
        "--no-baseline", action="store_true", help="skip running the tests on the unmutated copy first"
    )
    args = parser.parse_args(argv)
    names = [m.name for m in MUTATIONS]
    if len(set(names)) != len(names):
        raise SystemExit("two mutations share a name")
    try:
        chosen = selected(args.only)
    except ValueError as e:
        parser.error(str(e))
    if args.list:
        for m in chosen:
            print(f"{m.name}  [{m.expected}]  {m.path}\n    {m.why}\n    " + "\n    ".join(m.tests))
        return 0
    started, outcomes = time.monotonic(), []
    with tempfile.TemporaryDirectory(prefix="odrl-mutations-") as scratch:
        base = snapshot(Path(scratch) / "base")
        for m in chosen:  # every entry checked against the copy before anything runs
            try:
                checked_source(m, base)
            except StaleMutation as e:
                print(f"refused: {e}", file=sys.stderr)
                return 2
        problem = check_imports_from(base, "")
        if problem:
            print(
                f"refused: a child process in the copy does not import the copy: {problem}", file=sys.stderr
            )
            return 2
        baseline: dict[str, Run] = {}
        if not args.no_baseline:
            tests = list(dict.fromkeys(t for m in chosen for t in m.tests))
            print(f"baseline: {len(tests)} tests on the unmutated copy (each must pass)", flush=True)
            baseline = run_baseline(tests, base, Path(scratch), args.timeout)
            for test, run in baseline.items():
                label = {SURVIVED: "passes", CAUGHT: "FAILS"}.get(run.result, run.result)
                print(f"    {label:<8} {run.seconds:>7.1f}  {test}", flush=True)
        print(f"{'mutation':<46} {'result':<9} {'seconds':>8}  expected", flush=True)
        for m in chosen:
            outcome = run_mutation(m, base, Path(scratch), args.timeout, baseline)
            outcomes.append(outcome)
            mark = "" if outcome.matches else "  <-- does not match"
            expected = m.expected.split(":")[0] + (")" if ":" in m.expected else "")  # the gap: --list
            print(f"{m.name:<46} {outcome.result:<9} {outcome.seconds:>8.1f}  {expected}{mark}", flush=True)
            for run in outcome.runs:
                if run.result != CAUGHT:
                    print(f"    {run.result}: {run.test}: {run.summary}", flush=True)
            if outcome.note:
                print(f"    {outcome.note}", flush=True)
    total = time.monotonic() - started
    report = {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "python": str(PYTHON),
        "total_seconds": round(total, 1),
        "all_match": all(o.matches for o in outcomes),
        "baseline": [asdict(run) for run in baseline.values()],
        "mutations": [
            {**asdict(o), "why": m.why, "tests": list(m.tests)} for o, m in zip(outcomes, chosen, strict=True)
        ],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    print(f"{len(outcomes)} mutations in {total:.0f} s; wrote {args.output}")
    return 0 if report["all_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
