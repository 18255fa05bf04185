"""`odrl train`: post-training on one process, several, or several machines."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, describe, load_config
from ..runtime.launch_check import (
    STARTED,
    check_machines_agree,
    mark,
    wait_for_every_process,
)
from ..runtime.lifeline import exit_with_parent
from .arguments import _positive_int

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


CONFIG_KEYS = "(every config key)"  # `odrl train --help`'s epilog, filled in when help is printed


class _ConfigKeysFormatter(argparse.RawDescriptionHelpFormatter):
    """Prints the train command's epilog as the list of every config key, built only when help is
    shown: describe() imports every algorithm (peft among them, 1.4 s), which every other command
    and every training process would otherwise pay for at start-up."""

    def add_text(self, text: str | None) -> None:
        if text is CONFIG_KEYS:
            text = "Config keys (override any with section.key=value):\n  " + "\n  ".join(describe())
        super().add_text(text)


def _make_accelerator(use_wandb: bool):  # noqa: ANN202 - accelerate is imported lazily
    """accelerate's view of the processes: on CPU when asked (ACCELERATE_USE_CPU) or when no CUDA
    device is visible (accelerate would otherwise take an FSDP config on a CPU machine for one lone
    process per rank, and every process would write as the main one)."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator

    asked = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes")
    accelerator = Accelerator(
        cpu=asked or not torch.cuda.is_available(), log_with="wandb" if use_wandb else None
    )
    launched = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if launched != accelerator.num_processes:
        raise ConfigError(
            f"the launcher started {launched} processes but accelerate sees {accelerator.num_processes} "
            f"({accelerator.distributed_type}); check the accelerate config's distributed_type and use_cpu"
        )
    return accelerator


def cmd_train(args: argparse.Namespace) -> int:
    if args.config and _is_override(args.config):
        args.overrides.insert(0, args.config)  # no config file, only overrides
        args.config = None
    if args.show_prompts and not args.check:
        raise ConfigError(
            "--show-prompts prints what --check reads: give both (odrl train CONFIG --check --show-prompts N)"
        )
    machines = _machines(args)
    if (args.nproc > 1 or machines.count > 1) and "LOCAL_RANK" not in os.environ and not args.check:
        from ..runtime.launch import run_launched, without_option

        _check_process_layout(load_config(args.config, args.overrides), args.nproc * machines.count)
        machines.check_port_free()  # the checks made once, not per process; each runs this again:
        return run_launched(args.nproc, without_option(args.argv, "--nproc"), machines=machines)
    exit_with_parent()  # a killed launcher takes this process down (never a run started from a shell)
    mark(STARTED)  # tells `odrl train`'s launcher that the machines joined
    cfg = load_config(args.config, args.overrides)
    if args.check:
        return _preflight(args.config, cfg, args.show_prompts)
    from ..run_dir import prepare_run_dir
    from ..trainers.trainer import Trainer

    prepare_run_dir(cfg.train.output_dir, args.resume, cfg.train.overwrite, is_main=_launcher_rank() == 0)
    wait_for_every_process(args.join_timeout)  # several machines: every process started, or an error
    accelerator = _make_accelerator(cfg.tracking.wandb)
    check_machines_agree(cfg.to_dict(), device=accelerator.device)  # several machines: one layout, one config
    accelerator.wait_for_everyone()  # the main process has cleared the folder (train.overwrite)

    def run_mode(cfg, resume, recheck):  # noqa: ANN001, ANN202 - one mode on this process
        if cfg.execution.mode in ("separate", "hybrid"):
            from ..execution.separate import run_separate

            return run_separate(cfg, resume=resume, device=accelerator.device, recheck=recheck)
        trainer = Trainer(cfg, accelerator)
        trainer.recheck = recheck
        return trainer.fit(resume=resume)

    if cfg.execution.mode == "auto":
        from ..execution.planner.auto import run_auto

        summary = run_auto(cfg, accelerator.num_processes, accelerator.device, args.resume, run_mode)
    else:
        summary = run_mode(cfg, args.resume, None)
    if accelerator.is_main_process and summary is not None:
        print(json.dumps(summary), flush=True)
    _close_process_group()
    return 0


def _is_override(word: str) -> bool:
    """Whether a positional word is a key=value override rather than a file (which may hold '=')."""
    if "=" not in word:
        return False
    try:
        return not Path(word).exists()
    except OSError:  # a name too long for a path: an override
        return True


def _machines(args: argparse.Namespace):  # noqa: ANN202 - launch.Machines, imported lazily
    """The machines of the run as `odrl train`'s options give them (checked)."""
    from ..runtime.launch import Machines

    machines = Machines(
        count=args.nnodes,
        rank=args.node_rank or 0,
        master_addr=args.master_addr,
        master_port=args.master_port,
        join_timeout_s=args.join_timeout,
    )
    if machines.count > 1 and args.node_rank is None:
        raise ConfigError(
            f"--nnodes {machines.count} needs --node-rank: 0 on the machine at --master-addr, 1 .. "
            f"{machines.count - 1} on the others, each machine its own"
        )
    machines.check()
    return machines


def _check_process_layout(cfg, processes: int) -> None:  # noqa: ANN001 - ExperimentConfig
    """The layout checks every process would make, made once before they start (a ConfigError)."""
    if cfg.execution.mode in ("separate", "hybrid"):
        from ..execution.separate import check_layout

        check_layout(cfg, processes)
    elif cfg.data.prompts_per_step % processes:
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the {processes} "
            "processes so that each generates whole prompt groups"
        )


def _preflight(source: str | None, cfg, show_prompts: int = 0) -> int:  # noqa: ANN001 - ExperimentConfig
    """Print what the run needs and whether it is there, and the first `show_prompts` prompts of each
    split as the model reads them; 1 when something is missing."""
    from ..benchmarks.memory import check_rollout_memory
    from ..preflight import FAILING, preflight, prompts_as_read, report

    loaded: dict[str, list[str]] = {}
    findings = [*preflight(cfg, loaded), *check_rollout_memory(cfg)]
    missing = [f for f in findings if f.status in FAILING]
    print(
        f"{source or 'the default config'}: valid ({cfg.model.family}, {cfg.algorithm.name}, "
        f"{cfg.data.prompts_per_step} prompts x {cfg.data.group_size} samples per step)"
    )
    print(report(findings))
    if show_prompts and cfg.data.system_prompt is not None:
        print(f"the system turn of every prompt: {cfg.data.system_prompt}")
    for key, prompts in loaded.items() if show_prompts else ():
        print(f"{key}: the first {min(show_prompts, len(prompts))} of {len(prompts)} as the model reads them")
        for i, text in enumerate(prompts_as_read(cfg, prompts[:show_prompts]), 1):
            print(f"  [{i}] " + text.replace("\n", "\n      "))
    print(f"{len(missing)} to fix first (the lines marked MISSING or WRONG)" if missing else "ready to train")
    return 1 if missing else 0


def _close_process_group() -> None:
    """Every process done: tear the process group down before exit (left to interpreter shutdown,
    gloo's threads can abort a process that already finished its work)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _add_train(sub: Subcommands) -> None:
    """`odrl train`: post-training, on one machine or several."""
    train = sub.add_parser(
        "train",
        help="post-train a model with the config's algorithm and execution mode (--nproc N: N processes)",
        description="Post-train a model with the config's algorithm (DiffusionNFT, Flow-GRPO, RAFT, "
        "distillation or GSPO) in its execution mode (colocated, separate, hybrid or auto); prints a JSON "
        "line with the held-out results before and after.",
        epilog=CONFIG_KEYS,
        formatter_class=_ConfigKeysFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML config (e.g. recipes/configs/tiny_t2av_nft.yaml)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. algorithm.beta=0.1")
    train.add_argument("--resume", help="checkpoint directory, or a run's checkpoints/ folder (its latest)")
    train.add_argument(
        "--check",
        action="store_true",
        help="validate the config and check what it needs (model files, reward checkpoints or server, "
        "prompt files) without loading weights; exit 1 when something is missing",
    )
    train.add_argument(
        "--show-prompts",
        type=_positive_int,
        default=0,
        metavar="N",
        help="with --check: print the first N training and held-out prompts as the model reads them (a "
        "question's options rendered by data.choice_format)",
    )
    train.add_argument(
        "--nproc",
        type=_positive_int,
        default=1,
        help="processes to train with (on each machine, with --nnodes): starts them itself, through torch's "
        "elastic agent with --nnodes (GPUs if CUDA is visible, else CPU)",
    )
    _add_machine_options(train)
    train.set_defaults(func=cmd_train)


def _add_machine_options(parser: argparse.ArgumentParser) -> None:
    """`odrl train` on several machines: each machine's place and how they meet."""
    parser.add_argument(
        "--nnodes",
        type=_positive_int,
        default=1,
        help="machines to train on: run the same command on each, with its own --node-rank "
        "(docs/multi-machine.md)",
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=None,
        help="with --nnodes: this machine's place, 0 on the machine at --master-addr, 1 .. N-1 on the others",
    )
    parser.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="with --nnodes: the address of machine 0 that every machine reaches (default %(default)s)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="with --nnodes (required): a free TCP port on machine 0, the same on every machine",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        help="with --nnodes: seconds to wait for every machine (and each of its processes) to start; "
        "then stop with an error (default %(default)s)",
    )


def _launcher_rank() -> int:
    """This process's rank as a launcher (accelerate, torchrun) set it; 0 when run alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
