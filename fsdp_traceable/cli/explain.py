"""``python -m fsdp_traceable explain``: the command-line face of
:func:`fsdp_traceable.introspection.explain.explain` (its arguments: :mod:`.arguments`)."""

from __future__ import annotations

import argparse

from ..introspection.explain import DEMO_CONFIG, explain
from ..models.transformer import TransformerConfig
from ..whole_step.inductor_options import inductor_options
from .progress import say, still_running


def run_explain_command(args: argparse.Namespace, started: float) -> int:
    """Runs ``python -m fsdp_traceable explain`` with parsed ``args``; prints the report.

    Args:
        args: the parsed options (:func:`~fsdp_traceable.cli.arguments.add_explain_arguments`).
        started: when the command started (``time.time()``), the zero of the progress
            lines on standard error.

    Returns:
        The process exit code.
    """
    if args.dim < 4 or args.dim % DEMO_CONFIG.n_heads:
        raise ValueError(f"--dim must be a positive multiple of {DEMO_CONFIG.n_heads}, got {args.dim}")
    if args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    config = TransformerConfig(
        vocab_size=DEMO_CONFIG.vocab_size, dim=args.dim, n_layers=args.layers,
        n_heads=DEMO_CONFIG.n_heads, max_seq_len=DEMO_CONFIG.max_seq_len,
    )
    compiler = "AOTAutograd only" if args.aot_eager else "Inductor: a minute or more on CPU"
    say(f"compiling {args.steps} train step(s) on {args.world_size} fake ranks ({compiler})",
        started)
    with still_running("compiling", started):
        report = explain(
            world_size=args.world_size, out_dir=args.out, steps=args.steps, config=config,
            compiled_autograd=not (args.no_compiled_autograd or args.whole_step),
            whole_step=args.whole_step, inductor=not args.aot_eager,
            inductor_config=(inductor_options(raise_collectives=not args.whole_step)
                             if args.inductor_options else None),
        )
    print(report)
    return 0
