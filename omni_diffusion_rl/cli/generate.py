"""`odrl sample`, `odrl eval`, `odrl probe-rewards` and `odrl export`: what a run made, judged and shipped."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, load_config
from ..export import EXPORT_HELP, add_export_arguments, run_export
from .arguments import _check_output_file, _check_output_folder, _guidance_scale, _sampler_steps
from .train import _is_override

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def sample_guidance(checkpoint: str | None, given: float | None) -> float:
    """`odrl sample`'s guidance: --cfg-scale when given, else the checkpoint run's sampling.cfg_scale
    (sample as the run did), else 1 (off)."""
    if given is not None:
        return given
    if not checkpoint:
        return 1.0
    from ..checkpoint import checkpoint_sampling, load_checkpoint

    return checkpoint_sampling(load_checkpoint(checkpoint, objects=False)[2], checkpoint).cfg_scale


def cmd_sample(args: argparse.Namespace) -> int:
    from ..inference import generate_media, load_policy
    from ..media import save_previews
    from ..prompts import load_prompts

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
        from ..experience.guidance import checked_guidance

        checked_guidance(policy, scale)
    media = generate_media(
        policy, prompts, steps=args.steps, solver=args.solver, seed=args.seed, cfg_scale=scale
    )
    files = save_previews(args.output, media, prompts, None)
    print(json.dumps({"output": str(args.output), "files": sorted(files)}))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from ..evaluation.heldout import format_table, json_safe
    from ..evaluation.targets import evaluate_target, target_config

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
    from ..evaluation.clip_sync import folder_sync, sync_table
    from ..evaluation.heldout import json_safe

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
    from ..evaluation.heldout import format_table
    from ..reward_factory import reward_from_config
    from ..world import adversarial, sync_adversarial

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


def _add_export(sub: Subcommands) -> None:
    """`odrl export`: the trained adapter for other tools."""
    export = sub.add_parser("export", help=EXPORT_HELP)
    add_export_arguments(export)
    export.set_defaults(func=run_export)
