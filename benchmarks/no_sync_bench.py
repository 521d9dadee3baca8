"""Gradient accumulation under compile: step time of one optimizer step over N
microbatches (default 4), three ways, on local gloo ranks (default 2):

* ``compiled-sync-every-microbatch``: every microbatch's forward under
  ``torch.compile(fullgraph=True)`` and backward under compiled autograd, gradient
  sync on (one reduce-scatter per group per microbatch, accumulated sharded);
* ``eager-no-sync-compiled-last``: the documented way to skip the sync under compile:
  ``set_requires_gradient_sync(False)`` and eager forward and backward for all but the
  last microbatch, the last one compiled as above with sync on;
* ``fsdp2-eager-no-sync``: torch's FSDP2 eager with sync off for all but the last
  microbatch, the reference.

Modes are interleaved: after every mode's warm-up (the first step compiles, with an
empty Inductor cache), each round times one step of every mode in turn, so load
changes on the machine reach all modes alike. Reports the median step (the slower
rank's) and its ratio to ``fsdp2-eager-no-sync``; prints a markdown table and writes
JSON (default ``benchmarks/out/no_sync_bench.json``; with ``--publish``,
``benchmarks/results/no_sync_bench.json``).

Run: ``python benchmarks/no_sync_bench.py`` (``--help`` for the workload).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import fsdp_traceable
from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json
from fsdp_traceable.cli.launch import run_on_ranks
from fsdp_traceable.cli.train import TrainArgs, batch_for, mp_policy_for
from fsdp_traceable.models.transformer import Transformer, shard_transformer

COMPILED_SYNC = "compiled-sync-every-microbatch"
WORKAROUND = "eager-no-sync-compiled-last"
REFERENCE = "fsdp2-eager-no-sync"
MODES = (COMPILED_SYNC, WORKAROUND, REFERENCE)
ROOT = pathlib.Path(__file__).resolve().parents[1]

StepFn = Callable[[int], None]


def accumulation_step(mode: str, base: Transformer, args: TrainArgs, mesh: DeviceMesh,
                      microbatches: int) -> StepFn:
    """``step_fn(step)``: ``microbatches`` forward/backward calls and one AdamW step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    fully_shard_fn = fsdp2_fully_shard if mode == REFERENCE else fsdp_traceable.fully_shard
    model = shard_transformer(copy.deepcopy(base), fully_shard_fn, mesh=mesh,
                              mp_policy=mp_policy_for(args))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    compiled_loss = torch.compile(model.loss, fullgraph=True)
    backward_compiler = torch.compile(backend="inductor", fullgraph=True)

    def compiled_microbatch(tokens: torch.Tensor, targets: torch.Tensor) -> None:
        loss = compiled_loss(tokens, targets)
        with torch._dynamo.compiled_autograd._enable(backward_compiler):
            loss.backward()

    def step_fn(step: int) -> None:
        for micro in range(microbatches):
            last = micro == microbatches - 1
            data = batch_for(args, step * microbatches + micro, rank, world_size,
                             mesh.device_type)
            if mode == COMPILED_SYNC:
                compiled_microbatch(*data)
                continue
            model.set_requires_gradient_sync(last)
            if mode == WORKAROUND and last:
                compiled_microbatch(*data)
            else:
                model.loss(*data).backward()
        optimizer.step()
        optimizer.zero_grad()

    return step_fn


def _rank_main(args: TrainArgs, microbatches: int, steps: int, result_path: str) -> None:
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(args.seed)
    base = Transformer(args.config)
    step_fns = {mode: accumulation_step(mode, base, args, mesh, microbatches) for mode in MODES}
    first_step_s = {}
    for mode, step_fn in step_fns.items():
        dist.barrier()
        start = time.perf_counter()
        step_fn(0)
        first_step_s[mode] = time.perf_counter() - start
        step_fn(1)  # second warm-up: compiled autograd's accumulate-into-grad graph
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for round_index in range(steps):
        for mode, step_fn in step_fns.items():
            dist.barrier()
            start = time.perf_counter()
            step_fn(2 + round_index)
            times[mode].append(time.perf_counter() - start)
    rows = {}
    for mode in MODES:
        median = torch.tensor([statistics.median(times[mode])])
        dist.all_reduce(median, op=dist.ReduceOp.MAX)  # the slower rank decides
        rows[mode] = {"median_step_ms": median.item() * 1e3, "first_step_s": first_step_s[mode],
                      "min_step_ms": min(times[mode]) * 1e3, "max_step_ms": max(times[mode]) * 1e3}
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(rows, f)


def run(args: TrainArgs, microbatches: int, steps: int) -> dict:
    """Runs every mode on the same ranks; returns the report (see the module doc)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "no_sync_bench.json")
        previous_cache = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tmp, "inductor_cache")
        try:
            run_on_ranks(_rank_main, args, microbatches, steps, path,
                         world_size=args.world_size, device="cpu")
        finally:
            if previous_cache is None:
                os.environ.pop("TORCHINDUCTOR_CACHE_DIR")
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous_cache
        with open(path) as f:
            rows = json.load(f)
    reference = rows[REFERENCE]["median_step_ms"]
    for row in rows.values():
        row["ratio_to_fsdp2_eager_no_sync"] = row["median_step_ms"] / reference
    return {
        "args": asdict(args), "microbatches": microbatches, "timed_steps": steps, "modes": rows,
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "threads_per_rank": max(1, (os.cpu_count() or 1) // args.world_size),
    }


def format_table(report: dict) -> str:
    lines = ["| mode | median step (ms) | vs FSDP2 eager no-sync | range (ms) | first step (s) |",
             "|---|---:|---:|---:|---:|"]
    for mode, row in report["modes"].items():
        lines.append(
            f"| {mode} | {row['median_step_ms']:.1f} | {row['ratio_to_fsdp2_eager_no_sync']:.2f}x"
            f" | {row['min_step_ms']:.0f}-{row['max_step_ms']:.0f} | {row['first_step_s']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    defaults = TrainArgs(dim=256)
    for name in ("dim", "layers", "heads", "vocab_size", "seq_len", "batch_size", "world_size"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int,
                            default=getattr(defaults, name))
    parser.add_argument("--mp", choices=["bf16"], default=None, help="bf16 mixed precision")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="timed rounds (one step per mode)")
    add_output_arguments(parser, "no_sync_bench.json")
    options = parser.parse_args(argv)
    if options.microbatches < 2 or options.steps < 1:
        parser.error("--microbatches must be at least 2 and --steps at least 1")
    fields = {k: v for k, v in vars(options).items() if k in TrainArgs.__dataclass_fields__}
    report = run(TrainArgs(**fields, device="cpu"), options.microbatches, options.steps)
    report["provenance"] = provenance(ROOT)
    print(format_table(report))
    out = output_path(options.out, options.publish, "no_sync_bench.json", ROOT)
    write_json(out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
