"""Eager host cost per step against torch FSDP2, where host overhead dominates.

A deep, narrow model (default 16 blocks, d=32: 17 groups of tiny parameters) trained
eagerly by fsdp_traceable and by torch's FSDP2 from the same weights, on local gloo
ranks (default 1) with one intra-op thread. Each phase (forward, backward, optimizer
step) is timed by the main thread's CPU time (``time.thread_time``), so other load on
the machine changes the figures far less than it changes wall-clock time; the two
libraries are timed interleaved step by step. Reports the medians per phase, the step
total and its ratio to FSDP2; prints a markdown table and writes JSON (default
``benchmarks/out/eager_overhead_bench.json``; with ``--publish``,
``benchmarks/results/eager_overhead_bench.json``).

Run: ``python benchmarks/eager_overhead_bench.py`` (``--help`` for the workload).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import pathlib
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance
from fsdp_traceable.cli.launch import run_on_ranks
from fsdp_traceable.cli.train import TrainArgs, batch_for, make_optimizer
from fsdp_traceable.fsdp import fully_shard as ours_fully_shard
from fsdp_traceable.models.transformer import Transformer, shard_transformer

LIBRARIES = {"fsdp2": fsdp2_fully_shard, "fsdp_traceable": ours_fully_shard}
PHASES = ("forward", "backward", "optimizer")
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench_rank(args: TrainArgs, steps: int, result_path: str) -> None:
    torch.set_num_threads(1)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(args.seed)
    base = Transformer(args.config)
    trained = {}
    for name, fully_shard in LIBRARIES.items():
        model = copy.deepcopy(base)
        shard_transformer(model, fully_shard, mesh=mesh)
        trained[name] = (model, make_optimizer(args, model.parameters()))
    times = {name: {phase: [] for phase in PHASES} for name in LIBRARIES}
    for step in range(steps + 2):  # 2 warm-up steps
        for name, (model, optimizer) in trained.items():
            dist.barrier()
            start = time.thread_time()
            loss = model.loss(*batch_for(args, step, rank, world_size, "cpu"))
            forward_end = time.thread_time()
            loss.backward()
            backward_end = time.thread_time()
            optimizer.step()
            optimizer.zero_grad()
            end = time.thread_time()
            if step >= 2:
                for phase, seconds in zip(
                    PHASES, (forward_end - start, backward_end - forward_end, end - backward_end)
                ):
                    times[name][phase].append(seconds)
    if rank == 0:
        report = {
            name: {phase: statistics.median(values) * 1e3 for phase, values in phases.items()}
            for name, phases in times.items()
        }
        with open(result_path, "w") as f:
            json.dump(report, f)


def format_table(report: dict) -> str:
    """The markdown table of a report's per-library phase medians (ms)."""
    baseline = sum(report["fsdp2"][phase] for phase in PHASES)
    lines = ["| library | forward (ms) | backward (ms) | optimizer (ms) | step (ms) | vs FSDP2 |",
             "|---|---:|---:|---:|---:|---:|"]
    for name in LIBRARIES:
        phases = report[name]
        total = sum(phases[phase] for phase in PHASES)
        lines.append(f"| {name} | {phases['forward']:.2f} | {phases['backward']:.2f} | "
                     f"{phases['optimizer']:.2f} | {total:.2f} | {total / baseline:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--vocab-size", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=16)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per library")
    add_output_arguments(parser, "eager_overhead_bench.json")
    cli = parser.parse_args()
    args = TrainArgs(dim=cli.dim, layers=cli.layers, vocab_size=cli.vocab_size,
                     batch_size=cli.batch_size, seq_len=cli.seq_len, optimizer=cli.optimizer,
                     world_size=cli.world_size)
    out = output_path(cli.out, cli.publish, "eager_overhead_bench.json", ROOT)
    out.parent.mkdir(parents=True, exist_ok=True)
    run_on_ranks(_bench_rank, args, cli.steps, str(out), world_size=cli.world_size)
    report = json.loads(out.read_text())
    report["workload"] = {**vars(cli), "torch": torch.__version__, "machine": platform.machine(),
                          "date": datetime.date.today().isoformat()}
    report["provenance"] = provenance(ROOT)
    out.write_text(json.dumps(report, indent=2))
    print(format_table(report))


if __name__ == "__main__":
    main()
