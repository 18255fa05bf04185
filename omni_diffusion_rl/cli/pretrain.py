"""`odrl pretrain`, `odrl avqa-files` and `odrl tiny-qwen`: the tiny models and example data."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .arguments import _positive_int

if TYPE_CHECKING:
    from ..answer_data.clip_files import ClipFormat

    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def _label_noise(text: str) -> dict[str, float]:
    """'0.4' (every attribute) or 'color=0.5,shape=0.3' (the others keep the shipped recipe's) ->
    {attribute: probability}."""
    from ..world.pretrain import DEFAULT_LABEL_NOISE
    from ..world.tiny_world import ATTRIBUTE_OPTIONS

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
    from ..models.tiny_sync import SYNC_BASE_WEIGHTS
    from ..world.pretrain_sync import pretrain_sync_model

    if args.teacher or any(v is not None for v in (args.label_noise, args.parts, args.prompt_dropout)):
        print(
            "odrl pretrain: --sync takes no --teacher, --label-noise, --parts or --prompt-dropout",
            file=sys.stderr,
        )
        return 2
    from ..world.pretrain import check_pretrain_options

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
    from ..models.tiny_av import BUILTIN_WEIGHTS, SHIPPED_PART_TEACHERS, TEACHER_WEIGHTS

    if args.omni:
        from ..models.tiny_omni import OMNI_BASE
        from ..world.pretrain_omni import pretrain_omni_model

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
    from ..world.pretrain import TEACHER_RECIPE, TEACHER_STEPS, check_pretrain_options, pretrain_base_model

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


def cmd_avqa_files(args: argparse.Namespace) -> int:
    from ..world.avqa import split_scenes
    from ..world.avqa_files import QUESTION_FILE, write_example_set

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
    from ..answer_data.clip_files import ClipFormat, width_by_height
    from ..world.avqa_files import TINY_FORMAT

    size = width_by_height(args.size, "--size")
    if args.fps != round(args.fps):
        raise ValueError(f"--fps {args.fps:g}: an MP4 is written at a whole number of frames a second")
    clip = ClipFormat(args.fps, args.sample_rate, args.seconds, 1, size)
    if clip.frames * size[0] * size[1] * 3 > 64 << 20:
        raise ValueError(f"{clip.frames} frames of {args.size} are over 64 MiB a clip; lower --fps or --size")
    return TINY_FORMAT if clip == TINY_FORMAT else clip


def cmd_tiny_qwen(args: argparse.Namespace) -> int:
    from ..benchmarks.tiny_qwen import save_tiny_qwen_omni

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
