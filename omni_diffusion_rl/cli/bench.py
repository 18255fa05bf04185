"""`odrl bench` and `odrl simulate`: measurements and the execution-mode planner."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigError, ExecutionConfig, load_config
from .arguments import _check_output_file, _fraction, _ints, _names, _positive_int

if TYPE_CHECKING:
    Subcommands = argparse._SubParsersAction[argparse.ArgumentParser]


def cmd_bench(args: argparse.Namespace) -> int:
    steps = {} if args.steps is None else {"steps": args.steps}  # each bench has its own default
    repeats = args.repeats
    if args.output:
        _check_output_file(args.output)
    output = args.output or Path("runs/bench") / f"{args.name.replace('-', '_')}.json"
    if args.name == "recheck":
        from ..benchmarks.recheck import run_recheck_bench

        run_recheck_bench(output, args.config, args.overrides, **steps, repeats=repeats or 2)
    elif args.name == "modes":
        from ..benchmarks.modes import run_modes_bench

        run_modes_bench(output, args.config, args.overrides, **steps, repeats=repeats or 4)
    elif args.name == "learning":
        from ..benchmarks.learning import run_learning_bench

        run_learning_bench(output, args.config, args.overrides, modes=args.modes, seeds=args.seeds, **steps)
    elif args.name == "algorithms":
        from ..benchmarks.algorithms import run_algorithms_bench

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
        from ..benchmarks.teacher import run_teacher_bench

        parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
        # one part alone gets its own report, so it does not overwrite a full run's
        alone = f"_{parts[0]}" if len(parts) == 1 else ""
        output = args.output or Path(f"runs/bench/teacher{alone}.json")
        run_teacher_bench(output, args.config, args.overrides, **steps, repeats=repeats or 3, parts=parts)
    elif args.name == "memory":
        _bench_memory(output, args.measure, args.trace)
    elif args.name == "sharding":
        from ..benchmarks.sharding import run_sharding_bench

        run_sharding_bench(output, args.config, args.overrides, **steps, repeats=repeats or 3)
    elif args.name == "startup":
        from ..benchmarks.startup import run_startup_bench

        run_startup_bench(output, args.config, repeats=repeats or 5)
    elif args.name == "qwen-cost":
        from ..benchmarks.qwen_cost import run_qwen_cost_bench

        run_qwen_cost_bench(output, rounds=repeats or 5)
    elif args.name == "qwen-step":
        from ..benchmarks.qwen_step_cost import run_qwen_step_bench

        before = {"before": args.before} if args.before else {}
        try:
            run_qwen_step_bench(output, Path.cwd(), **before, steps=args.steps or 2, rounds=repeats or 1)
        except ValueError as e:  # not a checkout, or no such commit in it
            print(f"odrl bench qwen-step: {e}", file=sys.stderr)
            return 2
    elif args.name == "reward-server":
        from ..benchmarks.reward_server import run_reward_server_bench

        run_reward_server_bench(output, rounds=repeats or 5)
    else:
        from ..benchmarks.nft_step import run_nft_step_bench

        run_nft_step_bench(output, repeats=repeats or 5, batch_size=args.batch_size)
    return 0


def _bench_memory(output: Path, measure: bool, trace: bool) -> None:
    """`odrl bench memory`: on paper; with --measure, real runs of tiny models; with --trace, H3's
    micro-step, rollout forward and decode, LTX-2's micro-step and Qwen2.5-Omni-7B's and
    Qwen3-Omni-30B-A3B's GSPO micro-steps at full size on fake tensors (each its own report next to
    `output`)."""
    from ..benchmarks.memory import run_memory_bench

    run_memory_bench(output)
    if measure:
        from ..benchmarks.memory_measured import run_memory_measurement

        run_memory_measurement(output.with_name(output.stem + "_measured.json"))
    if trace:
        from ..benchmarks.memory_trace import run_trace
        from ..benchmarks.memory_trace_qwen import run_qwen_trace
        from ..benchmarks.memory_trace_rewards import run_reward_trace

        run_trace(output.with_name(output.stem + "_trace.json"))
        run_qwen_trace(output.with_name(output.stem + "_trace_qwen.json"))
        run_reward_trace(output.with_name(output.stem + "_trace_rewards.json"))


def cmd_simulate(args: argparse.Namespace) -> int:
    from ..execution.planner import costs as presets
    from ..execution.planner.costs import read_costs_file
    from ..execution.planner.simulate import format_report, simulate_settings

    reported = None
    _check_output_file(args.output)
    if args.measure:
        from ..execution.planner.measure import costs_to_json, measure_costs
        from ..runtime.threads import thread_share

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
