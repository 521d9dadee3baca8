"""``python -m fsdp_traceable plan``: a step's per-rank memory and communication at any
world size, traced on one CPU with fake tensors and a fake process group
(:mod:`fsdp_traceable.plan`)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict

from ..plan.extrapolate import Plan, make_plan
from ..plan.models import ShardSettings, model_source
from ..plan.plot import require_matplotlib, write_plot
from ..plan.report import format_plan, plan_json
from ..plan.trace import Workload
from .arguments import PlanArgs
from .progress import say


def plan_args_from(namespace: argparse.Namespace) -> PlanArgs:
    """The parsed flags, checked."""
    fields = PlanArgs.__dataclass_fields__
    args = PlanArgs(**{k: v for k, v in vars(namespace).items() if k in fields})
    for name in ("batch_size", "seq_len", "world_size", "tp", "pp", "dp_replicate"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.world_size % (args.tp * args.pp * args.dp_replicate):
        raise ValueError(f"--tp {args.tp} x --pp {args.pp} x --dp-replicate "
                         f"{args.dp_replicate} must divide --world-size {args.world_size}")
    microbatches = args.microbatches or args.pp
    if args.pp > 1 and args.batch_size % microbatches:
        raise ValueError(f"--batch-size {args.batch_size} (sequences per data-parallel rank) "
                         f"must divide into --microbatches {microbatches}: pass "
                         f"--batch-size {microbatches} or a multiple")
    return args


def plan_for(args: PlanArgs) -> Plan:
    """Builds, traces and extrapolates the plan of ``args``."""
    source = model_source(args.model, layers=args.layers, dim=args.dim, heads=args.heads,
                          vocab_size=args.vocab_size, seq_len=args.seq_len)
    settings = ShardSettings(tp=args.tp, param_dtype=args.param_dtype,
                             reduce_dtype=args.reduce_dtype,
                             reshard_after_forward=args.reshard_after_forward == "true",
                             ac=args.ac, pp=args.pp, microbatches=args.microbatches,
                             schedule=args.schedule, dp_replicate=args.dp_replicate,
                             offload=args.offload)
    workload = Workload(batch_size=args.batch_size, seq_len=args.seq_len,
                        optimizer=args.optimizer)
    return make_plan(source, args.world_size, settings, workload, full_trace=args.full_trace)


def setup_of(args: PlanArgs) -> dict:
    """The set-up a report names."""
    keys = ("model", "world_size", "tp", "param_dtype", "reduce_dtype",
            "reshard_after_forward", "ac", "batch_size", "seq_len", "optimizer")
    setup = {k: v for k, v in asdict(args).items() if k in keys}
    setup["dp"] = args.world_size // (args.tp * args.pp * args.dp_replicate)
    if args.dp_replicate > 1:
        setup["dp_replicate"] = args.dp_replicate
    if args.pp > 1:
        setup.update(pp=args.pp, schedule=args.schedule,
                     microbatches=args.microbatches or args.pp)
    if args.offload:
        setup["offload"] = "cpu"
    return setup


def run_plan_command(namespace: argparse.Namespace, started: float) -> int:
    """Runs ``plan`` and prints its table (or JSON)."""
    args = plan_args_from(namespace)
    if args.plot:
        require_matplotlib()  # before the trace, not after it
    say("building the model on meta and tracing its step on fake tensors", started)
    plan = plan_for(args)
    setup = setup_of(args)
    if args.plot:
        write_plot(plan, args.plot, args.model)
    if args.json:
        print(json.dumps(plan_json(plan, setup, args.gpu), indent=1))
    else:
        print(format_plan(plan, setup, args.gpu))
    return 0
