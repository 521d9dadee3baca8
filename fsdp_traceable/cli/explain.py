"""``python -m fsdp_traceable explain``: the command-line face of
:func:`fsdp_traceable.inspect.explain.explain`."""

from __future__ import annotations

import argparse

from ..collectives import inductor_options
from ..inspect.explain import DEMO_CONFIG, explain
from ..models.transformer import TransformerConfig


def add_explain_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the ``explain`` subcommand's options to ``parser``."""
    parser.add_argument("--out", default=None, help="directory for the graph and code dumps")
    parser.add_argument("--world-size", type=int, default=2, help="fake ranks (default 2)")
    parser.add_argument("--layers", type=int, default=DEMO_CONFIG.n_layers,
                        help=f"transformer blocks (default {DEMO_CONFIG.n_layers})")
    parser.add_argument("--dim", type=int, default=DEMO_CONFIG.dim,
                        help=f"model width, a multiple of 4 (default {DEMO_CONFIG.dim})")
    parser.add_argument("--steps", type=int, default=2, help="train steps (default 2)")
    parser.add_argument("--no-compiled-autograd", action="store_true",
                        help="use AOTAutograd's backward instead of compiled autograd")
    parser.add_argument("--inductor-options", action="store_true",
                        help="compile with fsdp_traceable.inductor_options() (overlap passes, "
                        "one reduce-scatter copy-in kernel per group; with --whole-step, "
                        "raise_collectives=False)")
    parser.add_argument("--whole-step", action="store_true",
                        help="forward, loss and backward as one graph (fsdp_traceable."
                        "compile_step, torch 2.11+) instead of compiled autograd")
    parser.add_argument("--aot-eager", action="store_true",
                        help="stop after AOTAutograd (faster; no generated code)")


def run_explain_command(args: argparse.Namespace) -> int:
    """Runs ``python -m fsdp_traceable explain`` with parsed ``args``; prints the report.

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
    report = explain(
        world_size=args.world_size, out_dir=args.out, steps=args.steps, config=config,
        compiled_autograd=not (args.no_compiled_autograd or args.whole_step),
        whole_step=args.whole_step, inductor=not args.aot_eager,
        inductor_config=(inductor_options(raise_collectives=not args.whole_step)
                         if args.inductor_options else None),
    )
    print(report)
    return 0
