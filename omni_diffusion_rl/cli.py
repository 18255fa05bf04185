"""`odrl`: the command line of omni-diffusion-rl."""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import sys
import tempfile
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from .config import MAX_SAMPLING_STEPS, MAX_STEP, ConfigError, ExecutionConfig, describe, load_config
from .export import EXPORT_HELP, add_export_arguments, run_export
from .runtime.launch_check import (
    REFUSED,
    STARTED,
    check_machines_agree,
    machine_count,
    mark,
    wait_for_every_process,
)
from .runtime.lifeline import exit_with_parent
from .runtime.startup import TRAINING_STACK, import_frozen

if TYPE_CHECKING:
    from .answer_data.clip_files import ClipFormat
    from .serving.server import ServeSettings

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
        from .runtime.launch import run_launched, without_option

        _check_process_layout(load_config(args.config, args.overrides), args.nproc * machines.count)
        machines.check_port_free()  # the checks made once, not per process; each runs this again:
        return run_launched(args.nproc, without_option(args.argv, "--nproc"), machines=machines)
    exit_with_parent()  # a killed launcher takes this process down (never a run started from a shell)
    mark(STARTED)  # tells `odrl train`'s launcher that the machines joined
    cfg = load_config(args.config, args.overrides)
    if args.check:
        return _preflight(args.config, cfg, args.show_prompts)
    from .run_dir import prepare_run_dir
    from .trainers.trainer import Trainer

    prepare_run_dir(cfg.train.output_dir, args.resume, cfg.train.overwrite, is_main=_launcher_rank() == 0)
    wait_for_every_process(args.join_timeout)  # several machines: every process started, or an error
    accelerator = _make_accelerator(cfg.tracking.wandb)
    check_machines_agree(cfg.to_dict(), device=accelerator.device)  # several machines: one layout, one config
    accelerator.wait_for_everyone()  # the main process has cleared the folder (train.overwrite)

    def run_mode(cfg, resume, recheck):  # noqa: ANN001, ANN202 - one mode on this process
        if cfg.execution.mode in ("separate", "hybrid"):
            from .execution.separate import run_separate

            return run_separate(cfg, resume=resume, device=accelerator.device, recheck=recheck)
        trainer = Trainer(cfg, accelerator)
        trainer.recheck = recheck
        return trainer.fit(resume=resume)

    if cfg.execution.mode == "auto":
        from .execution.planner.auto import run_auto

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
    from .runtime.launch import Machines

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
        from .execution.separate import check_layout

        check_layout(cfg, processes)
    elif cfg.data.prompts_per_step % processes:
        raise ConfigError(
            f"data.prompts_per_step={cfg.data.prompts_per_step} must be divisible by the {processes} "
            "processes so that each generates whole prompt groups"
        )


def _preflight(source: str | None, cfg, show_prompts: int = 0) -> int:  # noqa: ANN001 - ExperimentConfig
    """Print what the run needs and whether it is there, and the first `show_prompts` prompts of each
    split as the model reads them; 1 when something is missing."""
    from .benchmarks.memory import check_rollout_memory
    from .preflight import FAILING, preflight, prompts_as_read, report

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


def sample_guidance(checkpoint: str | None, given: float | None) -> float:
    """`odrl sample`'s guidance: --cfg-scale when given, else the checkpoint run's sampling.cfg_scale
    (sample as the run did), else 1 (off)."""
    if given is not None:
        return given
    if not checkpoint:
        return 1.0
    from .checkpoint import checkpoint_sampling, load_checkpoint

    return checkpoint_sampling(load_checkpoint(checkpoint, objects=False)[2], checkpoint).cfg_scale


def cmd_sample(args: argparse.Namespace) -> int:
    from .inference import generate_media, load_policy
    from .media import save_previews
    from .prompts import load_prompts

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += load_prompts(args.prompts_file)
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompts-file")
    _check_output_folder(args.output)
    policy = load_policy(args.checkpoint, args.pretrained)
    if getattr(policy, "kind", None) == "answers":
        raise ConfigError(
            f"{args.checkpoint} is an answering model (GSPO): `odrl sample` generates media; the run's "
            "previews and the notebook (make notebook) show its answers"
        )
    scale = sample_guidance(args.checkpoint, args.cfg_scale)
    if scale != 1.0:
        from .experience.guidance import checked_guidance

        checked_guidance(policy, scale)
    media = generate_media(
        policy, prompts, steps=args.steps, solver=args.solver, seed=args.seed, cfg_scale=scale
    )
    files = save_previews(args.output, media, prompts, None)
    print(json.dumps({"output": str(args.output), "files": sorted(files)}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluation.heldout import format_table, json_safe
    from .evaluation.targets import evaluate_target, target_config

    overrides = [t for t in args.targets if _is_override(t)]
    targets = [t for t in args.targets if t not in overrides]
    if args.output:
        _check_output_file(args.output)
    if args.clips is not None:
        if targets:
            raise ConfigError("odrl eval --clips FOLDER scores a folder of clips; name no targets beside it")
        return _eval_clips(args.clips, args.output)
    if not targets:
        raise ConfigError(
            "name at least one target to evaluate: a checkpoint, a model directory, base or world "
            "(or --clips FOLDER for a folder of clips with sound)"
        )
    results = {}
    for target in targets:
        cfg = target_config(target, args.config, overrides)
        results[target] = evaluate_target(target, cfg, with_reward=not args.no_reward)
    print(format_table(results))
    results = json_safe(results)  # a value nothing could score is null, not NaN
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(results, indent=1), encoding="utf-8")
    print(json.dumps(results), flush=True)
    return 0


def _eval_clips(folder: Path, output: Path | None) -> int:
    """`odrl eval --clips FOLDER`: the synchrony of every video file with sound in it."""
    from .evaluation.clip_sync import folder_sync, sync_table
    from .evaluation.heldout import json_safe

    try:
        result = folder_sync(folder)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    print(sync_table(result))
    result = json_safe(result)
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=1), encoding="utf-8")
    print(json.dumps(result), flush=True)
    return 0


def cmd_probe_rewards(args: argparse.Namespace) -> int:
    from .evaluation.heldout import format_table
    from .reward_factory import reward_from_config
    from .world import adversarial, sync_adversarial

    if args.config and _is_override(args.config):
        args.overrides.insert(0, args.config)  # no config file, only overrides
        args.config = None
    cfg = load_config(args.config, list(args.overrides))
    reward = reward_from_config(cfg.reward)
    try:
        world = sync_adversarial if cfg.model.family == "tiny_sync" else adversarial
        table = world.probe_rewards(reward)
    finally:
        reward.close()
    print(format_table(table))
    print(json.dumps(table), flush=True)
    return 0


def _label_noise(text: str) -> dict[str, float]:
    """'0.4' (every attribute) or 'color=0.5,shape=0.3' (the others keep the shipped recipe's) ->
    {attribute: probability}."""
    from .world.pretrain import DEFAULT_LABEL_NOISE
    from .world.tiny_world import ATTRIBUTE_OPTIONS

    try:
        if "=" not in text:
            return dict.fromkeys(ATTRIBUTE_OPTIONS, float(text))
        pairs = [part.split("=", 1) for part in text.split(",") if part.strip()]
        noise = {name.strip(): float(value) for name, value in pairs}
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected 0.4 or color=0.5,shape=0.3,... ({e})") from e
    unknown = sorted(set(noise) - set(ATTRIBUTE_OPTIONS))
    if unknown or not all(0 <= v <= 1 for v in noise.values()):
        raise argparse.ArgumentTypeError(
            f"label noise: attributes among {', '.join(ATTRIBUTE_OPTIONS)}, values in [0, 1]; got {text}"
        )
    return {**DEFAULT_LABEL_NOISE, **noise}


def _pretrain_sync(args: argparse.Namespace) -> int:
    """`odrl pretrain --sync`: the tiny sync world's base model."""
    from .models.tiny_sync import SYNC_BASE_WEIGHTS
    from .world.pretrain_sync import pretrain_sync_model

    if args.teacher or any(v is not None for v in (args.label_noise, args.parts, args.prompt_dropout)):
        print(
            "odrl pretrain: --sync takes no --teacher, --label-noise, --parts or --prompt-dropout",
            file=sys.stderr,
        )
        return 2
    from .world.pretrain import check_pretrain_options

    size = {key: getattr(args, key) for key in ("dim", "depth", "heads") if getattr(args, key) is not None}
    try:
        check_pretrain_options(**size)  # the tiny models' sizes: the same checks and defaults
    except ValueError as e:
        print(f"odrl pretrain: {e}", file=sys.stderr)
        return 2
    fillers, window = args.fillers or 0, args.text_window
    if not 0 <= fillers <= 16 or (window is not None and not 8 <= window <= 64):
        print("odrl pretrain: --fillers is 0 to 16 words, --text-window 8 to 64 words", file=sys.stderr)
        return 2
    size |= {} if window is None else {"max_text_tokens": window}
    steps = 6000 if args.steps is None else args.steps
    output = args.output or SYNC_BASE_WEIGHTS
    print(json.dumps(pretrain_sync_model(output, steps=steps, seed=args.seed, fillers=fillers, **size)))
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from .models.tiny_av import BUILTIN_WEIGHTS, SHIPPED_PART_TEACHERS, TEACHER_WEIGHTS

    if args.omni:
        from .models.tiny_omni import OMNI_BASE
        from .world.pretrain_omni import pretrain_omni_model

        diffusion_only = (args.label_noise, args.parts, args.prompt_dropout, args.dim, args.depth, args.heads)
        if args.teacher or args.sync or any(option is not None for option in diffusion_only):
            print(
                "odrl pretrain: --omni takes no --teacher, --sync, --label-noise, --parts, --prompt-dropout, "
                "--dim, --depth or --heads",
                file=sys.stderr,
            )
            return 2
        stages = {
            "steps": 1500 if args.steps is None else args.steps,
            "encoder_steps": 2500 if args.encoder_steps is None else args.encoder_steps,
            "align_steps": 600 if args.align_steps is None else args.align_steps,
        }
        print(json.dumps(pretrain_omni_model(args.output or OMNI_BASE, seed=args.seed, **stages)))
        return 0
    if args.encoder_steps is not None or args.align_steps is not None:
        print("odrl pretrain: --encoder-steps and --align-steps are stages of --omni", file=sys.stderr)
        return 2
    if not args.sync and (args.fillers is not None or args.text_window is not None):
        print("odrl pretrain: --fillers and --text-window are options of --sync", file=sys.stderr)
        return 2
    if args.sync:
        return _pretrain_sync(args)
    from .world.pretrain import TEACHER_RECIPE, TEACHER_STEPS, check_pretrain_options, pretrain_base_model

    recipe: dict[str, object] = dict(TEACHER_RECIPE) if args.teacher else {}
    if args.label_noise is not None:
        recipe["label_noise"] = args.label_noise
    size = {key: getattr(args, key) for key in ("dim", "depth", "heads")}
    recipe.update({key: value for key, value in size.items() if value is not None})
    if args.prompt_dropout is not None:
        recipe["prompt_dropout"] = args.prompt_dropout
        if not args.prompt_dropout:  # no empty prompt learned: no guidance to recommend
            recipe.pop("guidance", None)
    output = args.output or (TEACHER_WEIGHTS if args.teacher else BUILTIN_WEIGHTS)
    if args.parts is not None:
        if not args.parts:
            print("odrl pretrain: --parts names no part (e.g. --parts spectrum,loudness)", file=sys.stderr)
            return 2
        shipped = SHIPPED_PART_TEACHERS.get(frozenset(args.parts)) if args.teacher else None
        if args.output is None and shipped is None:
            print(
                "odrl pretrain: --parts makes a partial model; give it its own --output (only --teacher "
                "with picture,visibility or spectrum,loudness has a shipped location)",
                file=sys.stderr,
            )
            return 2
        output = args.output or shipped
        recipe["parts"] = args.parts
    try:
        check_pretrain_options(**recipe)  # type: ignore[arg-type]
    except ValueError as e:
        print(f"odrl pretrain: {e}", file=sys.stderr)
        return 2
    steps = args.steps or (TEACHER_STEPS if args.teacher else 6000)
    result = pretrain_base_model(output, steps=steps, seed=args.seed, **recipe)
    print(json.dumps(result))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    steps = {} if args.steps is None else {"steps": args.steps}  # each bench has its own default
    repeats = args.repeats
    if args.output:
        _check_output_file(args.output)
    output = args.output or Path("runs/bench") / f"{args.name.replace('-', '_')}.json"
    if args.name == "recheck":
        from .benchmarks.recheck import run_recheck_bench

        run_recheck_bench(output, args.config, args.overrides, **steps, repeats=repeats or 2)
    elif args.name == "modes":
        from .benchmarks.modes import run_modes_bench

        run_modes_bench(output, args.config, args.overrides, **steps, repeats=repeats or 4)
    elif args.name == "learning":
        from .benchmarks.learning import run_learning_bench

        run_learning_bench(output, args.config, args.overrides, modes=args.modes, seeds=args.seeds, **steps)
    elif args.name == "algorithms":
        from .benchmarks.algorithms import run_algorithms_bench

        run_algorithms_bench(
            output,
            args.overrides,
            args.contestants,
            args.seeds,
            args.steps or 240,
            args.eval_every,
            jobs=args.jobs,
        )
    elif args.name == "teacher":
        from .benchmarks.teacher import run_teacher_bench

        parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
        # one part alone gets its own report, so it does not overwrite a full run's
        alone = f"_{parts[0]}" if len(parts) == 1 else ""
        output = args.output or Path(f"runs/bench/teacher{alone}.json")
        run_teacher_bench(output, args.config, args.overrides, **steps, repeats=repeats or 3, parts=parts)
    elif args.name == "memory":
        _bench_memory(output, args.measure, args.trace)
    elif args.name == "sharding":
        from .benchmarks.sharding import run_sharding_bench

        run_sharding_bench(output, args.config, args.overrides, **steps, repeats=repeats or 3)
    elif args.name == "startup":
        from .benchmarks.startup import run_startup_bench

        run_startup_bench(output, args.config, repeats=repeats or 5)
    elif args.name == "qwen-cost":
        from .benchmarks.qwen_cost import run_qwen_cost_bench

        run_qwen_cost_bench(output, rounds=repeats or 5)
    elif args.name == "qwen-step":
        from .benchmarks.qwen_step_cost import run_qwen_step_bench

        before = {"before": args.before} if args.before else {}
        try:
            run_qwen_step_bench(output, Path.cwd(), **before, steps=args.steps or 2, rounds=repeats or 1)
        except ValueError as e:  # not a checkout, or no such commit in it
            print(f"odrl bench qwen-step: {e}", file=sys.stderr)
            return 2
    elif args.name == "reward-server":
        from .benchmarks.reward_server import run_reward_server_bench

        run_reward_server_bench(output, rounds=repeats or 5)
    else:
        from .benchmarks.nft_step import run_nft_step_bench

        run_nft_step_bench(output, repeats=repeats or 5, batch_size=args.batch_size)
    return 0


def _bench_memory(output: Path, measure: bool, trace: bool) -> None:
    """`odrl bench memory`: on paper; with --measure, real runs of tiny models; with --trace, H3's
    micro-step, rollout forward and decode, LTX-2's micro-step and Qwen2.5-Omni-7B's and
    Qwen3-Omni-30B-A3B's GSPO micro-steps at full size on fake tensors (each its own report next to
    `output`)."""
    from .benchmarks.memory import run_memory_bench

    run_memory_bench(output)
    if measure:
        from .benchmarks.memory_measured import run_memory_measurement

        run_memory_measurement(output.with_name(output.stem + "_measured.json"))
    if trace:
        from .benchmarks.memory_trace import run_trace
        from .benchmarks.memory_trace_qwen import run_qwen_trace
        from .benchmarks.memory_trace_rewards import run_reward_trace

        run_trace(output.with_name(output.stem + "_trace.json"))
        run_qwen_trace(output.with_name(output.stem + "_trace_qwen.json"))
        run_reward_trace(output.with_name(output.stem + "_trace_rewards.json"))


def _json_options(text: str | None, example: str) -> object:
    """--options parsed as JSON ({} when absent), or a ConfigError showing `example`."""
    try:
        return json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ConfigError(f"--options must be JSON, e.g. '{example}': {e}") from e
    except RecursionError as e:  # json nests by recursion
        raise ConfigError(f"--options nests too deeply for keyword arguments, e.g. '{example}'") from e


def _serve_settings(args: argparse.Namespace, **extra: float) -> ServeSettings:
    """The server settings the shared serve-reward / serve-teacher options give (checked)."""
    from .serving.server import ServeSettings

    token = os.environ.get(args.token_env) or None
    settings = ServeSettings(
        host=args.host,
        port=args.port,
        max_batch=args.max_batch,
        max_wait_ms=args.max_wait_ms,
        max_request_mb=args.max_request_mb,
        max_in_flight=args.max_in_flight,
        max_uploads_mb=args.max_uploads_mb,
        token=token,
        read_timeout_s=args.read_timeout_s,
        keepalive_timeout_s=args.keepalive_timeout_s,
        shutdown_timeout_s=args.shutdown_timeout_s,
        **extra,  # type: ignore[arg-type]
    )
    try:
        settings.check()
    except ValueError as e:
        raise ConfigError(str(e).replace("ODRL_REWARD_TOKEN", args.token_env)) from e
    return settings


def cmd_serve_teacher(args: argparse.Namespace) -> int:
    from .config import import_plugins
    from .registry import teachers

    import_plugins(args.plugin or [])
    options = _json_options(args.options, '{"pretrained": "/models/teacher"}')
    if not isinstance(options, dict):
        raise ConfigError("--options must be a JSON object of the teacher's keyword arguments")
    settings = _serve_settings(args, service_ms=args.service_ms)
    _check_can_listen(settings)  # before the teacher loads
    _thread_budget(args)
    for key, value in (("checkpoint", args.checkpoint), ("device", args.device)):
        if value:
            options.setdefault(key, value)
    try:
        teacher = teachers.create(args.name, **options)
    except TypeError as e:
        raise ConfigError(f"teacher '{args.name}' could not be created with {sorted(options)} ({e})") from e
    return _serve({}, settings, teachers={args.name: teacher})


def cmd_serve_reward(args: argparse.Namespace) -> int:
    from .config import import_plugins
    from .registry import rewards

    import_plugins(args.plugin or [])
    options = _json_options(args.options, '{"clap": {"checkpoint": "/m"}}')
    if not isinstance(options, dict) or not all(isinstance(v, dict) for v in options.values()):
        raise ConfigError("--options must map reward names to keyword-argument objects")
    unknown = sorted(set(options) - set(args.names))
    if unknown:
        raise ConfigError(f"--options names rewards that are not served: {unknown}")
    settings = _serve_settings(args)
    _check_can_listen(settings)  # before the rewards load
    _thread_budget(args)
    served = {}
    for name in args.names:
        kwargs = dict(options.get(name, {}))
        if args.checkpoint:
            kwargs.setdefault("checkpoint", args.checkpoint)
        if args.device:
            kwargs.setdefault("device", args.device)
        try:
            served[name] = rewards.create(name, **kwargs)
        except TypeError as e:
            raise ConfigError(
                f"reward '{name}' could not be created with {sorted(kwargs)} ({e}); give each reward its "
                "own keyword arguments with --options"
            ) from e
    return _serve(served, settings)


def _thread_budget(args: argparse.Namespace) -> int:
    """Set the server's thread budget before its models load: --threads, else OMP_NUM_THREADS when
    set, else its share of the host's cores; the ready line reports it."""
    from .runtime.threads import apply_thread_budget, thread_share

    given = os.environ.get("OMP_NUM_THREADS", "")
    default = int(given) if given.isdigit() and int(given) > 0 else thread_share(args.replicas_on_host)
    return apply_thread_budget(args.threads or default)


def _serve(rewards: dict, settings: ServeSettings, teachers: dict | None = None) -> int:
    """Run the server; a port taken since the check at start is a sentence too."""
    from .serving.server import main_serve

    with _listen_errors(settings):
        return main_serve(rewards, settings, teachers=teachers)


def _check_can_listen(settings: ServeSettings) -> None:
    """Refuse, before any model loads, a --host/--port this process cannot listen on."""
    if settings.port == 0:
        return
    with _listen_errors(settings):
        addresses = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM)
        for family, kind, proto, _, address in addresses:
            with socket.socket(family, kind, proto) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server binds
                probe.bind(address)


@contextmanager
def _listen_errors(settings: ServeSettings) -> Iterator[None]:
    """The OS errors of listening on --host/--port as ConfigError sentences; any other unchanged."""
    try:
        yield
    except OSError as e:
        refusal = _listen_refusal(e, settings.host, settings.port)
        if refusal is None:
            raise
        raise refusal from e


def _listen_refusal(e: OSError, host: str, port: int) -> ConfigError | None:
    """The sentence for an error listening on host:port, or None when it is none of those."""
    if isinstance(e, socket.gaierror):
        return ConfigError(f"--host {host} is not a name or address of this machine ({e.strerror})")
    reasons = {
        errno.EADDRINUSE: f"port {port} on {host} is in use (another server?): stop it, or pass another "
        "--port (0 picks a free one)",
        errno.EADDRNOTAVAIL: f"--host {host} is not an address of this machine: give one of its "
        "addresses, 127.0.0.1 (default) or 0.0.0.0 (every address, with a token)",
        errno.EACCES: f"port {port} on {host} needs privileges here: pass --port 1024 or above (0 picks a "
        "free one)",
    }
    reason = reasons.get(e.errno)
    return ConfigError(f"cannot listen: {reason}") if reason else None


def _check_output_folder(path: Path, option: str = "--output") -> None:
    """Refuse, before any work, an output folder that cannot be made or written to."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{option} {path} is not a folder; give a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ConfigError(
            f"{option} {path}: cannot write there ({e.strerror or e}); give a folder you can write to"
        ) from e


def _check_output_file(path: Path, option: str = "--output") -> None:
    """Refuse, before any work, an output file that could not be written."""
    if path.is_dir():
        raise ConfigError(f"{option} {path} is a folder; give a file name")
    _check_output_folder(path.parent, f"{option} {path}: the folder")


def cmd_simulate(args: argparse.Namespace) -> int:
    from .execution.planner import costs as presets
    from .execution.planner.costs import read_costs_file
    from .execution.planner.simulate import format_report, simulate_settings

    reported = None
    _check_output_file(args.output)
    if args.measure:
        from .execution.planner.measure import costs_to_json, measure_costs
        from .runtime.threads import thread_share

        cfg = load_config(args.measure, list(args.overrides))
        short, long = cfg.sampling.num_steps, args.long_steps or 4 * cfg.sampling.num_steps
        # 2 processes will share this machine's cores: time one with its share of them
        costs = measure_costs(cfg, short, long, threads=thread_share(2))
        work = {
            "replicas": 2,
            "prompts_per_step": cfg.data.prompts_per_step,
            "group_size": cfg.data.group_size,
            "rollout_replicas": 1,
        }
        spec = {
            "costs": costs_to_json(costs),
            "workloads": {"all": work},
            "lengths": {"short": short, "long": long},
        }
        costs_path = args.output.with_name(args.output.stem + "_costs.json")
        costs_path.parent.mkdir(parents=True, exist_ok=True)
        costs_path.write_text(json.dumps(spec, indent=1), encoding="utf-8")
        print(f"measured unit costs on this machine -> {costs_path} (reuse with --costs)")
        args.costs = str(costs_path)
    if args.costs:
        try:
            found = read_costs_file(args.costs)
            if not found.workloads or not found.lengths:
                raise ValueError(f"{args.costs}: no 'workloads' or no 'lengths' to simulate")
        except ValueError as e:
            raise ConfigError(
                f"--costs {e}. Expected JSON with 'costs' (CostModel fields), 'workloads' "
                "({'colocated': {...}, 'async': {...}} or {'all': {...}}; Workload fields) and 'lengths' "
                "({'short': 3, 'long': 40})"
            ) from e
        costs, workloads, lengths = found.costs, found.workloads, found.lengths
    else:
        costs, workloads = presets.SEED_4XH800_COSTS, presets.SEED_4XH800_WORKLOADS
        lengths, reported = presets.SEED_4XH800_LENGTHS, presets.SEED_4XH800_REPORTED
    report = simulate_settings(costs, workloads, lengths, steps=args.steps, margin=args.margin)
    print(format_report(report, reported))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"source": args.costs or args.preset, "report": report}, indent=1))
    print(f"wrote {args.output}")
    return 0


def _top_level_parts(text: str) -> list[str]:
    """text split at the commas outside brackets and braces: `a,b@k=[x,y]` is two parts."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char in "[{":
            depth += 1
        elif char in "]}":
            depth = max(depth - 1, 0)
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in _top_level_parts(text) if part.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected comma-separated names, e.g. colocated,separate")
    return names


def _guidance_scale(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value >= 1.0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 1 (1 is off), got {text!r}")
    return value


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in _names(text))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, e.g. 0,1,2 ({e})") from e


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from e
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1), got {value}")
    return value


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from e
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535 (0 picks a free one), got {value}")
    return value


def _positive_int(text: str, most: int = MAX_STEP) -> int:
    try:
        value = int(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from e
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    if value > most:
        raise argparse.ArgumentTypeError(f"must be at most {most}, got {value}")
    return value


def _sampler_steps(text: str) -> int:
    return _positive_int(text, MAX_SAMPLING_STEPS)


def add_server_arguments(parser: argparse.ArgumentParser, token_env: str, port: int) -> None:
    """The options every server takes: address, batching, limits, timeouts and its token."""
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=_port, default=port, help="0 picks a free port (see the ready line)")
    parser.add_argument(
        "--max-batch",
        type=_positive_int,
        default=32,
        help="samples per model call and per request",
    )
    parser.add_argument("--max-wait-ms", type=float, default=5.0, help="wait for a batch to fill, at most")
    parser.add_argument("--max-request-mb", type=float, default=256.0, help="larger requests get 413")
    parser.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=256,
        help="more concurrent requests get 503",
    )
    parser.add_argument(
        "--max-uploads-mb",
        type=float,
        default=4096.0,
        help="request bodies arriving at once, by declared size (chunked: --max-request-mb); more get 503",
    )
    parser.add_argument(
        "--read-timeout-s", type=float, default=30.0, help="time to receive a request's body; slower get 408"
    )
    parser.add_argument(
        "--keepalive-timeout-s",
        type=float,
        default=15.0,
        help="close connections idle (or without complete request headers) this long",
    )
    parser.add_argument(
        "--shutdown-timeout-s", type=float, default=2.0, help="on Ctrl-C, time for requests being answered"
    )
    parser.add_argument("--token-env", default=token_env, help="environment variable with the token")
    parser.add_argument(
        "--threads",
        type=_positive_int,
        help="threads the model computes on (default: OMP_NUM_THREADS when set, else the host's cores / "
        "--replicas-on-host)",
    )
    parser.add_argument(
        "--replicas-on-host",
        type=_positive_int,
        default=1,
        help="servers computing on this host at once, sharing its cores (sets the default --threads)",
    )


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


def _add_sample(sub: Subcommands) -> None:
    """`odrl sample`: media from a checkpoint or a base model."""
    sample = sub.add_parser(
        "sample", help="generate media from a checkpoint or a base model and save previews"
    )
    sample.add_argument("--checkpoint", help="checkpoint directory (uses its trained adapter)")
    sample.add_argument("--pretrained", default="builtin", help="base model when no checkpoint is given")
    sample.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    sample.add_argument("--prompts-file", help="UTF-8 file, one prompt per line")
    sample.add_argument("--steps", type=_sampler_steps, default=20, help="sampling steps (at most 1000)")
    sample.add_argument("--solver", default="euler", choices=("euler", "heun"))
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument(
        "--cfg-scale",
        type=_guidance_scale,
        help="classifier-free guidance, v(empty) + s (v(prompt) - v(empty)), 1 is off (default: the "
        "checkpoint run's sampling.cfg_scale, else 1)",
    )
    sample.add_argument("--output", type=Path, default=Path("runs/samples"))
    sample.set_defaults(func=cmd_sample)


def _add_eval(sub: Subcommands) -> None:
    """`odrl eval`: held-out evaluation of targets side by side."""
    evaluate = sub.add_parser(
        "eval",
        help="held-out evaluation of checkpoints, base models or the world's own clips, side by side",
        description="Generate the held-out set (fixed prompts and noise) with each target and score it with "
        "the training reward and eval.metrics (never trained on; the tiny world's per-attribute accuracy "
        "and health signs by default). Prints a table, then the results as one JSON line.",
    )
    evaluate.add_argument(
        "targets",
        nargs="*",
        metavar="TARGET",
        help="a checkpoint (a step_* folder or a run's checkpoints/ folder), a save_pretrained model "
        "directory, base (the config's base model) or world (the tiny world's own renders); "
        "section.key=value items are config overrides for all of them",
    )
    evaluate.add_argument(
        "--config",
        help="YAML config; for a checkpoint every section but model (the checkpoint's), and its "
        "sampling section, if any, replaces the checkpoint's",
    )
    evaluate.add_argument("--no-reward", action="store_true", help="only the eval metrics")
    evaluate.add_argument(
        "--clips",
        type=Path,
        metavar="FOLDER",
        help="instead of targets: the audio-visual synchrony of every video file with sound in FOLDER "
        "(MP4, MOV, MKV, WebM): audio onsets against motion events, AV-Align's IoU within one frame, "
        "the offset in ms (positive: the sound is late) and the event counts",
    )
    evaluate.add_argument("--output", type=Path, help="also write the results as JSON here")
    evaluate.set_defaults(func=cmd_eval)


def _add_probe_rewards(sub: Subcommands) -> None:
    """`odrl probe-rewards`: the config's rewards on honest and adversarial clips."""
    probe = sub.add_parser(
        "probe-rewards",
        help="score the tiny world's own clips and adversarial ones (flooded frame, tone for the whole "
        "clip, noise, blank, one attribute wrong, ...) with the config's rewards",
        description="Try to break the training reward before trusting it: each reward of reward.weights "
        "and their weighted total on the world's own clip of every scene and on clips a reward-gaming "
        "policy would make. A case that scores near 'world' can be gamed. A config of model.family "
        "tiny_sync probes the tiny sync world instead (a glide with a steady tone, a sound on every frame, "
        "the right count out of sync, ...), with its judge's verdict beside the rewards.",
    )
    probe.add_argument("config", nargs="?", help="YAML config (default: the built-in defaults)")
    probe.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. reward.weights=...")
    probe.set_defaults(func=cmd_probe_rewards)


def _add_pretrain(sub: Subcommands) -> None:
    """`odrl pretrain`: the tiny base model, its teacher or the tiny omni model."""
    pretrain = sub.add_parser(
        "pretrain",
        help="pre-train the tiny built-in base model (or, --teacher, its teacher) on synthetic clips",
    )
    pretrain.add_argument("--output", default=None, help="directory (default: the shipped builtin location)")
    pretrain.add_argument(
        "--steps",
        type=_positive_int,
        default=None,
        help="6000 (tiny_av); 12000 (--teacher); 1500 (--omni: its noisy-answer stage, after 2500 "
        "encoder and 600 clean-answer steps)",
    )
    pretrain.add_argument(
        "--encoder-steps", type=_positive_int, default=None, help="--omni: its encoder stage (2500)"
    )
    pretrain.add_argument(
        "--align-steps", type=_positive_int, default=None, help="--omni: its clean-answer stage (600)"
    )
    pretrain.add_argument(
        "--label-noise",
        type=_label_noise,
        default=None,
        help="chance that a clip's attribute ignores the prompt: 0.4 for all, or color=0.5,shape=0.3 "
        "(attributes not named keep the shipped model's recipe, 0.5)",
    )
    pretrain.add_argument("--seed", type=int, default=0)
    pretrain.add_argument(
        "--sync",
        action="store_true",
        help="the tiny sync world's base model instead (model.family=tiny_sync): its sound moved off its "
        "strikes and its counts off by one at times; default output the shipped builtin location",
    )
    pretrain.add_argument(
        "--teacher",
        action="store_true",
        help="the tiny teacher instead: larger (dim 128, 6 blocks), clean labels; default output "
        "the shipped builtin-teacher location",
    )
    pretrain.add_argument(
        "--parts",
        type=lambda text: [p.strip() for p in text.split(",") if p.strip()],
        default=None,
        help="learn only these parts of the latent (picture,visibility: a video-only teacher; "
        "spectrum,loudness: an audio-only one), for teacher.routes; with --teacher these two default "
        "to the shipped builtin-teacher-video / builtin-teacher-audio locations, others need --output",
    )
    pretrain.add_argument(
        "--prompt-dropout",
        type=float,
        default=None,
        help="share of clips trained on the empty prompt, so that classifier-free guidance works "
        "(the teacher's recipe: 0.1; the base: 0)",
    )
    for flag, what in (
        ("--dim", "width (base 96, teacher 128)"),
        ("--depth", "blocks (base 4, teacher 6)"),
        ("--heads", "attention heads (4); --dim must be a multiple"),
    ):
        pretrain.add_argument(flag, type=int, default=None, help=f"the model's {what}")
    pretrain.add_argument(
        "--fillers",
        type=int,
        default=None,
        help="--sync: up to this many meaningless words at random places in each training prompt, so "
        "that every attribute word is met at many positions (the shipped base: 0; tried: 8 with "
        "--text-window 32, docs/sync.md)",
    )
    pretrain.add_argument(
        "--text-window", type=int, default=None, help="--sync: the prompt words the model reads (24)"
    )
    pretrain.add_argument(
        "--omni",
        action="store_true",
        help="the tiny omni language model (GSPO's base) on tiny AVQA with confused labels instead; "
        "default output the shipped builtin-omni location",
    )
    pretrain.set_defaults(func=cmd_pretrain)


def _add_serve_reward(sub: Subcommands) -> None:
    """`odrl serve-reward`: registered rewards over HTTP."""
    serve = sub.add_parser(
        "serve-reward",
        help="serve registered rewards over HTTP (batched), for reward.url",
        description="Serve registered rewards over HTTP: POST /score/NAME (safetensors media), GET /info, "
        "GET /health. Prints a JSON 'ready' line with the URL once listening. Binding anything but "
        "loopback needs a bearer token in the environment (--token-env).",
    )
    serve.add_argument("names", nargs="+", metavar="NAME", help="registered reward names to serve")
    serve.add_argument("--checkpoint", help="checkpoint= for each served reward (e.g. a CLAP directory)")
    serve.add_argument("--device", help="device= for each served reward (e.g. cuda:0)")
    serve.add_argument("--options", help='JSON keyword arguments per reward: {"clap": {"max_seconds": 5}}')
    serve.add_argument(
        "--plugin", action="append", help="import this module or .py file first (it registers rewards)"
    )
    add_server_arguments(serve, "ODRL_REWARD_TOKEN", 8400)
    serve.set_defaults(func=cmd_serve_reward)


def _add_serve_teacher(sub: Subcommands) -> None:
    """`odrl serve-teacher`: a registered teacher over HTTP."""
    teach = sub.add_parser(
        "serve-teacher",
        help="serve a registered teacher over HTTP (batched), for teacher.urls",
        description="Serve a teacher over HTTP: POST /velocity/NAME (safetensors states, times and prompts; "
        "answers velocities), GET /info (its latent layout, convention and fingerprint), GET /health. "
        "Prints a JSON 'ready' line with the URL once listening. Binding anything but loopback needs a "
        "bearer token in the environment (--token-env).",
    )
    teach.add_argument("name", metavar="NAME", help="registered teacher (e.g. policy)")
    teach.add_argument("--checkpoint", help="checkpoint= of the teacher (a training checkpoint for 'policy')")
    teach.add_argument("--device", help="device= of the teacher (e.g. cuda:1)")
    teach.add_argument(
        "--options", help='JSON keyword arguments: {"pretrained": "builtin-teacher", "cfg_scale": 1}'
    )
    teach.add_argument(
        "--plugin", action="append", help="import this module or .py file first (it registers teachers)"
    )
    teach.add_argument(
        "--service-ms",
        type=float,
        default=0.0,
        help="benchmarks only: add this fixed time per model call, a stand-in for a remote accelerator",
    )
    add_server_arguments(teach, "ODRL_TEACHER_TOKEN", 8500)
    teach.set_defaults(func=cmd_serve_teacher)


def cmd_avqa_files(args: argparse.Namespace) -> int:
    from .world.avqa import split_scenes
    from .world.avqa_files import QUESTION_FILE, write_example_set

    for split, count in (("train", args.train_clips), ("heldout", args.heldout_clips)):
        scenes = len(split_scenes(heldout=split == "heldout"))
        if count > scenes:
            print(
                f"odrl avqa-files: --{split}-clips {count}: the {split} split has {scenes} scenes",
                file=sys.stderr,
            )
            return 2
    output = Path(args.output)
    held = [p for p in (output / QUESTION_FILE, output / "clips") if p.exists()]
    if held and not args.overwrite:
        print(
            f"odrl avqa-files: {output} already holds {' and '.join(p.name for p in held)}, which this "
            "would overwrite; give another --output, or --overwrite to replace them",
            file=sys.stderr,
        )
        return 2
    try:
        clip = _example_format(args)
    except ValueError as e:
        print(f"odrl avqa-files: {e}", file=sys.stderr)
        return 2
    try:
        path = write_example_set(
            output, args.train_clips, args.heldout_clips, args.seed, clip, args.sound_in_mp4
        )
    except OSError as e:
        print(
            f"odrl avqa-files: cannot write the example set into {output}: {e.strerror or e}", file=sys.stderr
        )
        return 2
    print(json.dumps({"question_file": str(path), "clips": args.train_clips + args.heldout_clips}))
    return 0


def _example_format(args: argparse.Namespace) -> ClipFormat:
    """The clip format --fps, --seconds, --sample-rate and --size ask for (a ValueError saying why
    one cannot be written)."""
    from .answer_data.clip_files import ClipFormat, width_by_height
    from .world.avqa_files import TINY_FORMAT

    size = width_by_height(args.size, "--size")
    if args.fps != round(args.fps):
        raise ValueError(f"--fps {args.fps:g}: an MP4 is written at a whole number of frames a second")
    clip = ClipFormat(args.fps, args.sample_rate, args.seconds, 1, size)
    if clip.frames * size[0] * size[1] * 3 > 64 << 20:
        raise ValueError(f"{clip.frames} frames of {args.size} are over 64 MiB a clip; lower --fps or --size")
    return TINY_FORMAT if clip == TINY_FORMAT else clip


def cmd_tiny_qwen(args: argparse.Namespace) -> int:
    from .benchmarks.tiny_qwen import save_tiny_qwen_omni

    output = Path(args.output)
    if output.exists() and not output.is_dir():
        print(f"odrl tiny-qwen: {output} is a file; give a folder as --output", file=sys.stderr)
        return 2
    if output.exists() and any(output.iterdir()) and not args.overwrite:
        print(f"odrl tiny-qwen: {output} is not empty; give another --output or --overwrite", file=sys.stderr)
        return 2
    save_tiny_qwen_omni(output)
    print(json.dumps({"model": str(output), "family": "qwen2_5_omni", "sample_rate": 8000}))
    return 0


def _add_tiny_qwen(sub: Subcommands) -> None:
    """`odrl tiny-qwen`: a tiny random-init Qwen2.5-Omni thinker, to try the Qwen path offline."""
    tiny = sub.add_parser(
        "tiny-qwen",
        help="write a tiny random-init Qwen2.5-Omni thinker (qwen2_5_omni family, 8 kHz sound) to try the "
        "Qwen path with no download; its answers mean nothing",
    )
    tiny.add_argument("--output", required=True, help="folder for the model")
    tiny.add_argument("--overwrite", action="store_true", help="write into a folder that is not empty")
    tiny.set_defaults(func=cmd_tiny_qwen)


def _add_avqa_files(sub: Subcommands) -> None:
    """`odrl avqa-files`: tiny AVQA written as a user's question file, with real MP4 and WAV clips."""
    files = sub.add_parser(
        "avqa-files",
        help="write tiny-world clips as MP4 + WAV files and a question file about them (an example set)",
    )
    files.add_argument("--output", required=True, help="folder for questions.jsonl and clips/")
    files.add_argument("--train-clips", type=_positive_int, default=12, help="clips of training scenes (12)")
    files.add_argument("--heldout-clips", type=_positive_int, default=4, help="clips of held-out scenes (4)")
    files.add_argument("--seed", type=int, default=0)
    files.add_argument(
        "--fps", type=float, default=8.0, help="frames a second (8: the tiny world's; Qwen: 2)"
    )
    files.add_argument("--seconds", type=float, default=0.5, help="clip length (0.5; Qwen's recipe: 4)")
    files.add_argument(
        "--sample-rate", type=_positive_int, default=8000, help="sound samples a second (8000; Qwen: 16000)"
    )
    files.add_argument("--size", default="16x16", help="frame WIDTHxHEIGHT (16x16; may be non-square)")
    files.add_argument(
        "--sound-in-mp4",
        action="store_true",
        help="the sound as each MP4's own AAC track (lines name the video alone) instead of WAV files",
    )
    files.add_argument(
        "--overwrite", action="store_true", help="replace questions.jsonl and clips/ already in --output"
    )
    files.set_defaults(func=cmd_avqa_files)


def _add_export(sub: Subcommands) -> None:
    """`odrl export`: the trained adapter for other tools."""
    export = sub.add_parser("export", help=EXPORT_HELP)
    add_export_arguments(export)
    export.set_defaults(func=run_export)


def _add_simulate(sub: Subcommands) -> None:
    """`odrl simulate`: the execution modes on a virtual clock."""
    simulate = sub.add_parser(
        "simulate",
        help="predict seconds per trained prompt of colocated / separate / hybrid (virtual clock)",
        description="Discrete-event simulation of the execution modes with the real buffer and scheduler "
        "decisions and a cost model: the seed's 4 x H800 preset, or --costs FILE.json.",
    )
    simulate.add_argument("--preset", default="seed-4xh800", choices=("seed-4xh800",))
    simulate.add_argument(
        "--margin",
        type=_fraction,
        default=ExecutionConfig().auto_switch_margin,
        help="auto's pick rule: colocated unless another mode is this fraction faster (steady seconds "
        "per prompt); execution.auto_switch_margin (default %(default)s)",
    )
    simulate.add_argument("--costs", help="JSON with 'costs', 'workloads' and 'lengths' instead of a preset")
    simulate.add_argument(
        "--steps",
        type=_positive_int,
        default=20,
        help="optimizer steps simulated per mode",
    )
    simulate.add_argument(
        "--measure",
        metavar="CONFIG",
        help="measure unit costs of this training config here (2 processes: 2+0 / 1+1)",
    )
    simulate.add_argument(
        "--long-steps",
        type=_positive_int,
        help="sampling steps of the long setting (default 4x the config's)",
    )
    simulate.add_argument("overrides", nargs="*", help="section.key=value overrides for --measure")
    simulate.add_argument("--output", type=Path, default=Path("runs/simulate/report.json"))
    simulate.set_defaults(func=cmd_simulate)


def _add_bench(sub: Subcommands) -> None:
    """`odrl bench`: the benchmarks."""
    bench = sub.add_parser(
        "bench",
        help="benchmarks: nft-step (NFT vs flow-matching step), reward-server (batching, client overhead), "
        "modes (auto, colocated, separate, hybrid with 2 processes, against the simulator), "
        "learning (held-out reward per execution mode over seeds, against colocated), "
        "recheck (auto's re-check after a wrong first pick, and its cost), "
        "memory (an on-paper estimate of GPU memory per process for the LTX-2 and H3 recipes; --measure adds "
        "the bytes each process holds in real sharded and unsharded runs of tiny models), "
        "teacher (distillation's teacher: overlapped, one-step-off and blocking schedules, 1 vs 2 "
        "teacher servers), "
        "sharding (2 processes, train.sharding=fsdp against none: seconds per step), "
        "algorithms (a race of nft, flow_grpo, mixgrpo, raft, distill on the tiny world: held-out judge "
        "accuracy against training seconds and samples, over seeds), "
        "startup (a training process's imports and a 2-step run, garbage collector on vs paused and frozen), "
        "qwen-cost (a Qwen rollout's sound features and towers, before against now), "
        "qwen-step (whole GSPO steps of the Qwen2.5-Omni recipe at --before's commit and now)",
    )
    bench.add_argument(
        "name",
        choices=(
            "nft-step",
            "reward-server",
            "modes",
            "learning",
            "recheck",
            "memory",
            "teacher",
            "sharding",
            "algorithms",
            "startup",
            "qwen-cost",
            "qwen-step",
        ),
    )
    _add_bench_options(bench)
    bench.set_defaults(func=cmd_bench)


def _add_bench_options(parser: argparse.ArgumentParser) -> None:
    """The options of `odrl bench`; each help says which benchmarks read it."""
    parser.add_argument(
        "--measure",
        action="store_true",
        help="memory: also measure tiny_av, LTX-2 and H3 (tiny random-init) at 1, 2 and 4 processes, "
        "sharded and not (a few minutes; writes <output>_measured.json)",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="memory: also trace H3 at the recipe's size per rank of 8 (a training micro-step, a rollout "
        "forward and one rank's decode), LTX-2's micro-step, forward and decode, Qwen2.5-Omni-7B's and "
        "Qwen3-Omni-30B-A3B's GSPO micro-step and forward, and the ImageBind reward's request, on fake "
        "tensors (about 18 min, and up to 30 more for Qwen3-Omni's 128 experts, no GPU; "
        "writes <output>_trace.json, <output>_trace_qwen.json and <output>_trace_rewards.json)",
    )
    parser.add_argument(
        "--config",
        default="recipes/configs/tiny_t2av_nft.yaml",
        help="modes, learning, recheck, sharding, startup: training config",
    )
    parser.add_argument(
        "--steps",
        type=_positive_int,
        help="modes, learning, recheck, algorithms, qwen-step: optimizer steps per run (default: modes 8, "
        "learning 20, recheck 16, algorithms 240, qwen-step 2)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="modes, learning, recheck, algorithms: section.key=value overrides"
    )
    parser.add_argument(
        "--modes",
        type=_names,
        default=("colocated", "separate", "hybrid"),
        help="learning: comma-separated execution modes (colocated is the reference); ALGORITHM:MODE "
        "runs another algorithm, e.g. colocated,raft:colocated",
    )
    parser.add_argument(
        "--seeds", type=_ints, default=(0, 1, 2), help="learning, algorithms: comma-separated seeds"
    )
    parser.add_argument(
        "--contestants",
        type=_names,
        default=("nft", "flow_grpo", "mixgrpo", "raft", "distill"),
        help="algorithms: comma-separated contestants of the race; a variant is BASE@key=value@..., "
        "e.g. nft@algorithm.adv_per_reward=true (commas inside [...] or {...} belong to the value)",
    )
    parser.add_argument(
        "--eval-every", type=_positive_int, default=20, help="algorithms: steps between held-out evaluations"
    )
    parser.add_argument(
        "--before",
        help="qwen-step: the commit to compare the working tree against (default: 480645a, the one before "
        "the Qwen rollout's cost changes)",
    )
    parser.add_argument(
        "--jobs",
        type=_positive_int,
        default=1,
        help="algorithms: runs trained at once, each with an equal share of the cores as its threads",
    )
    parser.add_argument(
        "--parts",
        default="schedules,replicas",
        help="teacher: comma-separated parts to run: schedules (overlapped, one step off, blocking), "
        "replicas (1 against 2 teacher servers); one part alone reports to runs/bench/teacher_<part>.json",
    )
    parser.add_argument("--output", type=Path, help="JSON report (default runs/bench/<name>.json)")
    parser.add_argument(
        "--repeats",
        type=_positive_int,
        help="rounds (default: nft-step, reward-server, startup 5; recheck 2; qwen-step 1)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=32)


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
        from .prompts import PromptFileError

        return _refuse(type(e).__name__, str(e), per_machine=isinstance(e, (ConfigError, PromptFileError)))


def _explained_errors() -> tuple[type[Exception], ...]:
    """The project's error types: each says what was wrong and what to do in one sentence (imported
    when an error happens, so that a plain command does not import the servers' client)."""
    from .checkpoint import CheckpointError
    from .media import NonFiniteSamples
    from .prompts import PromptFileError
    from .registry import RegistryError
    from .reward import RewardError
    from .serving.teacher_client import TeacherServerError
    from .teacher import TeacherMismatch

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


def _launcher_rank() -> int:
    """This process's rank as a launcher (accelerate, torchrun) set it; 0 when run alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


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


if __name__ == "__main__":
    sys.exit(entry())
