"""`odrl` itself: the parser of every command, the one-sentence errors and the entry point."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from typing import TYPE_CHECKING

from ..config import ConfigError
from ..runtime.launch_check import (
    REFUSED,
    machine_count,
    mark,
)
from ..runtime.startup import TRAINING_STACK, import_frozen
from .bench import _add_bench, _add_simulate
from .generate import _add_eval, _add_export, _add_probe_rewards, _add_sample
from .pretrain import _add_avqa_files, _add_pretrain, _add_tiny_qwen
from .serve import _add_serve_reward, _add_serve_teacher
from .train import _add_train, _launcher_rank

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    """The `odrl` command line: one subcommand per `_add_*` function, in the order `--help` lists them."""
    parser = argparse.ArgumentParser(prog="odrl", description="Post-train diffusion generators with RL.")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (
        _add_train,
        _add_sample,
        _add_eval,
        _add_probe_rewards,
        _add_pretrain,
        _add_avqa_files,
        _add_tiny_qwen,
        _add_serve_reward,
        _add_serve_teacher,
        _add_export,
        _add_simulate,
        _add_bench,
    ):
        add(sub)
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with positional words after an option kept: `odrl eval base --no-reward
    data.eval_samples=32` (argparse alone stops collecting a positional list at the first option)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # `train --nproc N` launches it again
    if extra:
        trailing = next(
            (name for name in ("targets", "overrides") if isinstance(getattr(args, name, None), list)), None
        )
        if trailing is None or any(item.startswith("-") for item in extra):
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
        getattr(args, trailing).extend(extra)
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the command; the project's errors (and the specific OS errors the commands explain) end it
    with one sentence and exit code 2; anything else is a bug and keeps its traceback."""
    args = parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        if _launcher_rank() == 0:
            print(
                "odrl: interrupted; a training run continues from its last checkpoint with --resume",
                file=sys.stderr,
            )
        return 130
    except SystemExit as e:  # odrl's commands return their code: this came from a plug-in or library
        return _refuse("SystemExit", _exit_sentence(e, args.command), per_machine=False)
    except Exception as e:
        if not isinstance(e, _explained_errors()):
            raise
        from ..prompts import PromptFileError

        return _refuse(type(e).__name__, str(e), per_machine=isinstance(e, (ConfigError, PromptFileError)))


def _explained_errors() -> tuple[type[Exception], ...]:
    """The project's error types: each says what was wrong and what to do in one sentence (imported
    when an error happens, so that a plain command does not import the servers' client)."""
    from ..checkpoint import CheckpointError
    from ..media import NonFiniteSamples
    from ..prompts import PromptFileError
    from ..registry import RegistryError
    from ..reward import RewardError
    from ..serving.teacher_client import TeacherServerError
    from ..teacher import TeacherMismatch

    return (
        ConfigError,
        PromptFileError,
        RegistryError,
        CheckpointError,
        NonFiniteSamples,
        RewardError,
        TeacherServerError,
        TeacherMismatch,
    )


def _refuse(kind: str, sentence: str, per_machine: bool) -> int:
    """Print `odrl: KIND: sentence` (a configuration error once per machine, anything else from every
    process that hit it), tell a launcher the run was refused, exit code 2."""
    rank = _launcher_rank()
    if rank == 0 or _first_on_machine() or not per_machine:
        where = f" (process {rank})" if rank else ""
        print(f"odrl: {kind}{where}: {sentence}", file=sys.stderr)
    mark(REFUSED)  # a launched process: its launcher exits 2 too, showing the sentence alone
    return 2


def _exit_sentence(e: SystemExit, command: str) -> str:
    """Who called sys.exit during `odrl COMMAND`, and what to do instead."""
    frames = traceback.extract_tb(e.__traceback__)
    caller = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
    return (
        f"`odrl {command}` was ended by sys.exit({e.code!r}){caller}; a plug-in must raise an error "
        "instead of exiting"
    )


def _first_on_machine() -> bool:
    """Whether this process reports a configuration error for its machine: on several machines (each
    with its own terminal) the first process of each does; on one, process 0 alone."""
    return machine_count() > 1 and os.environ.get("LOCAL_RANK", "0") == "0"


# The commands whose process imports the training stack (or torch alone), and what they import first.
STARTUP_IMPORTS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(
        ("train", "sample", "eval", "probe-rewards", "pretrain", "serve-teacher", "export", "bench"),
        TRAINING_STACK,
    ),
    "serve-reward": ("torch",),
}


def entry(argv: list[str] | None = None) -> int:
    """The `odrl` console script, `python -m omni_diffusion_rl.cli` and the recipes: main(argv) once
    the command's start-up imports are made with the garbage collector paused and frozen
    (runtime/startup.py, about 1.3 CPU-s less per process). Only a process's own entry point calls
    this; main() never freezes."""
    argv = sys.argv[1:] if argv is None else argv
    modules = STARTUP_IMPORTS.get(argv[0] if argv else "")
    if modules:
        import_frozen(modules)
    return main(argv)
