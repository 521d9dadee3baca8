"""Command line: ``python -m fsdp_traceable {train,bench,demo,explain,plan,doctor}``.

* ``train``: trains the built-in transformer with ``fully_shard`` (:mod:`.train`).
* ``bench``: step time and memory of every mode next to torch FSDP2 (:mod:`.bench`).
* ``demo``: all-gathers and reduces a bucket on local gloo ranks (:mod:`.demo`).
* ``plan``: a step's per-rank memory and communication at any world size, traced on
  fake tensors (:mod:`.plan`).
* ``explain``: compiles a train step on a fake process group and reports its graphs
  (:mod:`.explain`).
* ``doctor``: the versions, what the package detects of this torch, the recipes it
  runs here and the torch patches in place (:mod:`.doctor`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .arguments import (
    HelpFormatter,
    add_bench_arguments,
    add_explain_arguments,
    add_plan_arguments,
    add_train_arguments,
)
from .bench_output import add_output_arguments
from .progress import process_start_time, say


def build_parser() -> argparse.ArgumentParser:
    """The commands' parser; builds without importing torch or a command's module, so
    ``--help`` answers at once."""
    parser = argparse.ArgumentParser(
        prog="fsdp-traceable", description="FSDP2's collectives as traceable ops",
        formatter_class=HelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="all-gather and reduce a bucket on local gloo ranks",
                               formatter_class=HelpFormatter)
    demo.add_argument("--world-size", type=int, default=2, help="ranks to spawn")
    train = commands.add_parser("train", help="train the built-in transformer with fully_shard",
                                formatter_class=HelpFormatter)
    add_train_arguments(train)
    bench = commands.add_parser("bench", help="step time vs torch FSDP2 on one workload",
                                formatter_class=HelpFormatter)
    add_bench_arguments(bench)
    add_output_arguments(bench, "")
    explain = commands.add_parser(
        "explain", help="compile a train step on a fake process group and report its graphs",
        formatter_class=HelpFormatter,
    )
    add_explain_arguments(explain)
    plan = commands.add_parser(
        "plan", help="per-rank memory and per-step communication at any world size, traced "
                     "on fake tensors", formatter_class=HelpFormatter)
    add_plan_arguments(plan)
    doctor = commands.add_parser(
        "doctor", help="versions, detected torch features, available recipes, torch patches",
        formatter_class=HelpFormatter)
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen subcommand.

    Args:
        argv: command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code.
    """
    args = build_parser().parse_args(argv)
    started = process_start_time()
    if args.command == "doctor":
        from .doctor import run_doctor

        return run_doctor(args.json)
    if args.command == "plan":
        say(f"plan: {args.model} on {args.world_size} fake ranks; loading torch", started)
        from .plan import run_plan_command

        return run_plan_command(args, started)
    if args.command == "explain":
        say("explain: loading the compiler", started)
        from .explain import run_explain_command

        return run_explain_command(args, started)
    if args.command == "bench":
        say("bench: loading torch FSDP2 and the compiler", started)
        from . import bench
        from .bench_output import output_path, provenance
        from .train import train_args_from

        modes = tuple(args.modes.split(",")) if args.modes else bench.default_modes()
        report = bench.run_bench(train_args_from(args), steps=args.bench_steps, modes=modes,
                                 with_inductor_options=args.inductor_options, started=started)
        if report:
            report["provenance"] = provenance()
            print(bench.format_table(report))
            out = output_path(args.out, args.publish, "")
            print("wrote", ", ".join(bench.write_outputs(report, str(out))))
        return 0
    if args.command == "train":
        say(f"train: {args.mode} on {args.world_size} ranks; loading the training code",
            started)
        from .train import format_summary, train_args_from
        from .train import train as run_train

        result = run_train(train_args_from(args), started)
        if result:
            print(format_summary(result))
        return 0
    if args.command == "demo":
        say(f"demo: starting {args.world_size} local gloo ranks", started)
        from .demo import run_demo

        run_demo(args.world_size)
    return 0
