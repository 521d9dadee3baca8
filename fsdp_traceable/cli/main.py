"""Command line: ``python -m fsdp_traceable {train,bench,demo,explain}``.

* ``train``: trains the built-in transformer with ``fully_shard`` (:mod:`.train`).
* ``bench``: step time and memory of every mode next to torch FSDP2 (:mod:`.bench`).
* ``demo``: all-gathers and reduces a bucket on local gloo ranks (:mod:`.demo`).
* ``explain``: compiles a train step on a fake process group and reports its graphs
  (:mod:`.explain`).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Parses ``argv`` and runs the chosen subcommand.

    Args:
        argv: command-line arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code.
    """
    parser = argparse.ArgumentParser(
        prog="fsdp-traceable", description="FSDP2's collectives as traceable ops"
    )
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="all-gather and reduce a bucket on local gloo ranks")
    demo.add_argument("--world-size", type=int, default=2, help="ranks to spawn (default 2)")
    train = commands.add_parser("train", help="train the built-in transformer with fully_shard")
    from .train import add_train_arguments

    add_train_arguments(train)
    bench = commands.add_parser("bench", help="step time vs torch FSDP2 on one workload")
    add_train_arguments(bench)
    bench.add_argument("--bench-steps", type=int, default=10, help="timed steps per mode")
    bench.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    bench.add_argument("--inductor-options", action="store_true",
                       help="compile our modes with fsdp_traceable.inductor_options() (the "
                            "whole step with raise_collectives=False), the README's recipe; "
                            "without it, Inductor's defaults")
    from .bench_output import add_output_arguments

    add_output_arguments(bench, "")
    explain = commands.add_parser(
        "explain", help="compile a train step on a fake process group and report its graphs"
    )
    from .explain import add_explain_arguments, run_explain_command

    add_explain_arguments(explain)
    args = parser.parse_args(argv)
    if args.command == "explain":
        return run_explain_command(args)
    if args.command == "bench":
        from .bench import default_modes, format_table, run_bench, write_outputs
        from .bench_output import output_path, provenance
        from .train import train_args_from

        modes = tuple(args.modes.split(",")) if args.modes else default_modes()
        report = run_bench(train_args_from(args), steps=args.bench_steps, modes=modes,
                           with_inductor_options=args.inductor_options)
        if report:
            report["provenance"] = provenance()
            print(format_table(report))
            out = output_path(args.out, args.publish, "")
            print("wrote", ", ".join(write_outputs(report, str(out))))
        return 0
    if args.command == "train":
        from .train import format_summary, train_args_from
        from .train import train as run_train

        result = run_train(train_args_from(args))
        if result:
            print(format_summary(result))
        return 0
    if args.command == "demo":
        from .demo import run_demo

        run_demo(args.world_size)
    return 0
