"""`odrl`: the command line of omni-diffusion-rl."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .config import ConfigError, describe, load_config

EPILOG = "Config keys (override any with section.key=value):\n  " + "\n  ".join(describe())


def _make_accelerator(use_wandb: bool):  # noqa: ANN202 - accelerate is imported lazily
    from accelerate import Accelerator

    return Accelerator(
        cpu=os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"),
        log_with="wandb" if use_wandb else None,
    )


def cmd_train(args: argparse.Namespace) -> int:
    if args.config and "=" in args.config and not Path(args.config).exists():
        args.overrides.insert(0, args.config)  # no config file, only overrides
        args.config = None
    cfg = load_config(args.config, args.overrides)
    from .trainers.nft import NFTTrainer

    accelerator = _make_accelerator(cfg.tracking.wandb)
    trainer = NFTTrainer(cfg, accelerator)
    summary = trainer.fit(resume=args.resume)
    if accelerator.is_main_process:
        print(json.dumps(summary), flush=True)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from .inference import generate_media, load_policy
    from .media import save_previews
    from .prompts import load_prompts

    prompts = list(args.prompt or [])
    if args.prompts_file:
        prompts += load_prompts(args.prompts_file)
    if not prompts:
        raise ConfigError("give at least one --prompt or a --prompts-file")
    policy = load_policy(args.checkpoint, args.pretrained)
    media = generate_media(policy, prompts, steps=args.steps, solver=args.solver, seed=args.seed)
    files = save_previews(args.output, media, prompts, None)
    print(json.dumps({"output": str(args.output), "files": sorted(files)}))
    return 0


def cmd_pretrain(args: argparse.Namespace) -> int:
    from .models.tiny_av import BUILTIN_WEIGHTS
    from .world.pretrain import pretrain_base_model

    result = pretrain_base_model(
        args.output or BUILTIN_WEIGHTS, steps=args.steps, label_noise=args.label_noise, seed=args.seed
    )
    print(json.dumps(result))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run_nft_step_bench

    run_nft_step_bench(args.output, repeats=args.repeats, batch_size=args.batch_size)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="odrl", description="Post-train diffusion generators with RL.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser(
        "train",
        help="post-train a policy with DiffusionNFT (colocated; use accelerate launch for several processes)",
        description="Post-train with DiffusionNFT; prints a JSON line with the held-out reward before/after.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    train.add_argument("config", nargs="?", help="YAML config (e.g. recipes/configs/tiny_t2av_nft.yaml)")
    train.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. algorithm.beta=0.1")
    train.add_argument("--resume", help="checkpoint directory, or a run's checkpoints/ folder (its latest)")
    train.set_defaults(func=cmd_train)

    sample = sub.add_parser(
        "sample", help="generate media from a checkpoint or a base model and save previews"
    )
    sample.add_argument("--checkpoint", help="checkpoint directory (uses its trained adapter)")
    sample.add_argument("--pretrained", default="builtin", help="base model when no checkpoint is given")
    sample.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    sample.add_argument("--prompts-file", help="UTF-8 file, one prompt per line")
    sample.add_argument("--steps", type=int, default=20)
    sample.add_argument("--solver", default="euler", choices=("euler", "heun"))
    sample.add_argument("--seed", type=int, default=0)
    sample.add_argument("--output", type=Path, default=Path("runs/samples"))
    sample.set_defaults(func=cmd_sample)

    pretrain = sub.add_parser("pretrain", help="pre-train the tiny built-in base model on synthetic clips")
    pretrain.add_argument("--output", default=None, help="directory (default: the shipped builtin location)")
    pretrain.add_argument("--steps", type=int, default=1500)
    pretrain.add_argument("--label-noise", type=float, default=0.5)
    pretrain.add_argument("--seed", type=int, default=0)
    pretrain.set_defaults(func=cmd_pretrain)

    bench = sub.add_parser("bench", help="benchmarks: nft-step (NFT step vs plain flow-matching step)")
    bench.add_argument("name", choices=("nft-step",))
    bench.add_argument("--output", type=Path, default=Path("runs/bench/nft_step.json"))
    bench.add_argument("--repeats", type=int, default=5)
    bench.add_argument("--batch-size", type=int, default=32)
    bench.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError
    from .prompts import PromptFileError
    from .registry import RegistryError
    from .reward import RewardError

    try:
        return args.func(args)
    except (ConfigError, PromptFileError, RegistryError, CheckpointError, RewardError) as e:
        print(f"odrl: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
