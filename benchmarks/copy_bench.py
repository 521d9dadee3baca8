"""Eager copy-in + copy-out time of one all-gather bucket: ours vs FSDP2 vs memcpy.

For each workload the timed step is the copy work around one all-gather, without the
collective itself (world size 2, on the last rank, fp32, no cast; the all-gather output
is simulated as the ``[world * n]`` buffer every rank would receive):

* ours: ``torch.ops.fsdp_traceable.all_gather_copy_in`` on this rank's (unpadded)
  shards, then ``all_gather_copy_out`` on the gathered buffer, both allocating their
  outputs, as the library's default eager path (``config.copy_kernels="inductor"``)
  runs them;
* FSDP2: ``torch.ops.fsdp.all_gather_copy_in`` into a preallocated all-gather output
  from FSDP2's padded shards, then ``torch.ops.fsdp.split_with_sizes_copy`` into
  preallocated unsharded parameters, as ``torch.distributed.fsdp`` calls them (its
  per-step buffer allocation is left out, which favours FSDP2 slightly);
* memcpy: one ``copy_`` of the copy-in's bytes plus one of the copy-out's bytes.

Before timing, ours and FSDP2 are checked to produce identical bytes. Prints a
markdown table and writes JSON (default ``benchmarks/out/copy_bench.json``; with
``--publish``, ``benchmarks/results/copy_bench.json``).

Run: ``python benchmarks/copy_bench.py`` (or ``make bench-copy``).
"""

from __future__ import annotations

import argparse
import datetime
import math
import pathlib
import platform
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (torch.ops.fsdp)
from torch.utils import benchmark

import fsdp_traceable  # noqa: F401  (torch.ops.fsdp_traceable)
from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json
from fsdp_traceable.collectives import foreach_copies
from fsdp_traceable.sizes import flatten_sizes, padded_sharded_size

WORLD_SIZE = 2
ROOT = pathlib.Path(__file__).resolve().parents[1]


def transformer_block_shapes(dim: int = 1024, hidden: int = 2816) -> list[tuple[int, ...]]:
    """A Llama-style block: q/k/v/o ``[d, d]``, MLP w1/w3 ``[hidden, d]``, w2
    ``[d, hidden]``, and the two RMSNorm weights ``[d]``."""
    return [(dim, dim)] * 4 + [(hidden, dim), (hidden, dim), (dim, hidden), (dim,), (dim,)]


def small_param_shapes(count: int = 100, seed: int = 0) -> list[tuple[int, ...]]:
    """``count`` parameters of about 1K to 64K elements, vectors and matrices, many with
    an odd dim 0 so that their shards are padded."""
    rng = random.Random(seed)
    shapes: list[tuple[int, ...]] = []
    for i in range(count):
        numel = int(2 ** rng.uniform(10, 16))
        if i % 4 == 0:
            shapes.append((numel,))
        else:
            cols = rng.choice([16, 32, 64, 128])
            shapes.append((max(1, numel // cols), cols))
    return shapes


@dataclass
class CopyCase:
    """Everything the three contenders need for one bucket, built once."""

    ours: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]
    ours_foreach: Callable[[], tuple[torch.Tensor, list[torch.Tensor]]]
    fsdp2: Callable[[], None]
    fsdp2_input: torch.Tensor
    fsdp2_unsharded: list[torch.Tensor]
    memcpy: Callable[[], None]
    copy_in_bytes: int
    copy_out_bytes: int
    full_params: list[torch.Tensor]


def make_case(
    shapes: Sequence[tuple[int, ...]],
    world_size: int,
    dtype: torch.dtype = torch.float32,
    rank: int | None = None,
) -> CopyCase:
    """Builds the bucket's parameters, every rank's shards and the three copy steps.

    Args:
        shapes: the unsharded parameter sizes, all sharded on dim 0.
        world_size: number of simulated ranks.
        dtype: parameter and all-gather dtype.
        rank: the rank whose copy-in is timed; ``None`` takes the last rank, whose
            shards of an uneven dim 0 are the short ones that need padding.

    Returns:
        The :class:`CopyCase`.
    """
    rank = world_size - 1 if rank is None else rank
    torch.manual_seed(0)
    fulls = [torch.randn(shape, dtype=dtype) for shape in shapes]
    padded_sizes = [padded_sharded_size(shape, 0, world_size) for shape in shapes]
    padded_numels = [math.prod(size) for size in padded_sizes]
    # FSDP2 keeps each shard padded to ``padded_numel``; ours holds the unpadded shard.
    padded_shards = [
        [torch.zeros(numel, dtype=dtype) for numel in padded_numels] for _ in range(world_size)
    ]
    shards = []
    for r in range(world_size):
        rank_shards = []
        for full, size, padded in zip(fulls, padded_sizes, padded_shards[r]):
            rows = full[r * size[0] : (r + 1) * size[0]]
            padded[: rows.numel()].copy_(rows.reshape(-1))
            rank_shards.append(rows.clone())
        shards.append(rank_shards)
    numel = sum(padded_numels)
    gathered = torch.cat(
        [torch.ops.fsdp_traceable.all_gather_copy_in(s, padded_numels, dtype) for s in shards]
    )
    sizes_flat, ndims = flatten_sizes(shapes)
    shard_dims, dtypes = [0] * len(shapes), [dtype] * len(shapes)

    def ours() -> tuple[torch.Tensor, list[torch.Tensor]]:
        flat_input = torch.ops.fsdp_traceable.all_gather_copy_in(shards[rank], padded_numels, dtype)
        return flat_input, torch.ops.fsdp_traceable.all_gather_copy_out(
            gathered, world_size, sizes_flat, ndims, shard_dims, dtypes
        )

    def ours_foreach() -> tuple[torch.Tensor, list[torch.Tensor]]:
        flat_input = foreach_copies.all_gather_copy_in(shards[rank], padded_numels, dtype)
        return flat_input, foreach_copies.all_gather_copy_out(
            gathered, world_size, sizes_flat, ndims, shard_dims, dtypes
        )

    fsdp2_output = torch.empty(numel * world_size, dtype=dtype)
    fsdp2_params = [torch.empty(world_size * n, dtype=dtype) for n in padded_numels]
    fsdp2_out_views = [p.view(world_size, -1) for p in fsdp2_params]
    gathered_2d = gathered.view(world_size, -1)

    def fsdp2() -> None:
        torch.ops.fsdp.all_gather_copy_in(
            padded_shards[rank], fsdp2_output, padded_numels, numel, rank
        )
        torch.ops.fsdp.split_with_sizes_copy(gathered_2d, padded_numels, dim=1, out=fsdp2_out_views)

    # FSDP2's unsharded parameters are views into its all-gather outputs, made once
    # (not per step), so they are not part of the timed step.
    fsdp2_unsharded = [p[: full.numel()].view(full.shape) for p, full in zip(fsdp2_params, fulls)]
    fsdp2_input = fsdp2_output[rank * numel : (rank + 1) * numel]

    itemsize = torch.empty((), dtype=dtype).element_size()
    in_src, in_dst = torch.randn(numel).to(dtype), torch.empty(numel, dtype=dtype)
    out_src, out_dst = gathered.clone(), torch.empty_like(gathered)

    def memcpy() -> None:
        in_dst.copy_(in_src)
        out_dst.copy_(out_src)

    return CopyCase(
        ours, ours_foreach, fsdp2, fsdp2_input, fsdp2_unsharded, memcpy,
        copy_in_bytes=numel * itemsize,
        copy_out_bytes=numel * world_size * itemsize,
        full_params=fulls,
    )


def check_case(case: CopyCase) -> None:
    """Ours and FSDP2 must pack the same all-gather input and rebuild the full
    parameters bit for bit."""
    for tensor in (case.fsdp2_input, *case.fsdp2_unsharded):
        tensor.fill_(float("nan"))
    case.fsdp2()
    flat_input, unsharded = case.ours()
    foreach_input, foreach_unsharded = case.ours_foreach()
    if not torch.equal(flat_input, case.fsdp2_input) or not torch.equal(foreach_input, flat_input):
        raise AssertionError("ours and FSDP2 pack different all-gather inputs")
    for name, outputs in (("ours", unsharded), ("ours_foreach", foreach_unsharded),
                          ("fsdp2", case.fsdp2_unsharded)):
        for got, want in zip(outputs, case.full_params, strict=True):
            if got.shape != want.shape or not torch.equal(got, want):
                raise AssertionError(f"{name} copy-out does not reproduce the parameters")


def median_us(fn: Callable[[], object], min_run_time: float, threads: int) -> float:
    """Median wall time of ``fn`` in microseconds over one ``blocked_autorange``."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=threads)
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e6


CONTENDERS = ("ours", "ours_foreach", "fsdp2", "memcpy")


def time_case(
    case: CopyCase, rounds: int, min_run_time: float, threads: int
) -> dict[str, list[float]]:
    """Per-round medians of every contender, the contenders interleaved round by round
    so that a load change on the machine hits all of them alike."""
    steps = {key: getattr(case, key) for key in CONTENDERS}
    for step in steps.values():  # warm-up: allocator, first-call dispatch
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {key: [] for key in CONTENDERS}
    for _ in range(rounds):
        for key, step in steps.items():
            times[key].append(median_us(step, min_run_time, threads))
    return times


def run(rounds: int, min_run_time: float, threads: int, world_size: int = WORLD_SIZE) -> list[dict]:
    """Times every workload and returns one result row each."""
    workloads = {
        "transformer block (d=1024, 9 params)": transformer_block_shapes(),
        "100 small params (1K-64K elems)": small_param_shapes(),
    }
    rows = []
    for name, shapes in workloads.items():
        case = make_case(shapes, world_size)
        check_case(case)
        times = time_case(case, rounds, min_run_time, threads)
        # The best round is the one least disturbed by other load on the machine.
        best = {key: min(times[key]) for key in CONTENDERS}
        rows.append(
            {
                "workload": name,
                "params": len(shapes),
                "copy_in_bytes": case.copy_in_bytes,
                "copy_out_bytes": case.copy_out_bytes,
                **{f"{key}_us": best[key] for key in CONTENDERS},
                "ours_over_memcpy": best["ours"] / best["memcpy"],
                "ours_over_fsdp2": best["ours"] / best["fsdp2"],
                "ours_foreach_over_memcpy": best["ours_foreach"] / best["memcpy"],
                "ours_foreach_over_fsdp2": best["ours_foreach"] / best["fsdp2"],
                "rounds_us": times,
            }
        )
    return rows


def markdown_table(rows: Sequence[dict]) -> str:
    lines = [
        "| workload | bytes in + out | ours: aten (us) | ours: foreach (us) | FSDP2 (us) "
        "| memcpy (us) | aten/memcpy | aten/FSDP2 | foreach/memcpy | foreach/FSDP2 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        mib = (row["copy_in_bytes"] + row["copy_out_bytes"]) / 2**20
        lines.append(
            f"| {row['workload']} | {mib:.1f} MiB | {row['ours_us']:.0f} "
            f"| {row['ours_foreach_us']:.0f} | {row['fsdp2_us']:.0f} "
            f"| {row['memcpy_us']:.0f} | {row['ours_over_memcpy']:.2f} "
            f"| {row['ours_over_fsdp2']:.2f} | {row['ours_foreach_over_memcpy']:.2f} "
            f"| {row['ours_foreach_over_fsdp2']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the benchmark, prints the table and writes the JSON.

    Args:
        argv: command-line arguments; ``None`` reads ``sys.argv``.

    Returns:
        The process exit code.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads (default 1)")
    parser.add_argument("--rounds", type=int, default=7,
                        help="interleaved measurement rounds per workload (default 7)")
    parser.add_argument("--min-run-time", type=float, default=0.5,
                        help="seconds of measurement per contender and round (default 0.5)")
    add_output_arguments(parser, "copy_bench.json")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.min_run_time <= 0:
        parser.error("--threads and --rounds must be >= 1 and --min-run-time > 0")

    torch.set_num_threads(args.threads)
    rows = run(args.rounds, args.min_run_time, args.threads)
    table = markdown_table(rows)
    print(table)
    command = ["python benchmarks/copy_bench.py", *(sys.argv[1:] if argv is None else argv)]
    report = {
        "date": datetime.date.today().isoformat(),
        "command": " ".join(command),
        "torch": torch.__version__,
        "machine": f"{platform.machine()} CPU, {args.threads} thread(s)",
        "world_size": WORLD_SIZE,
        "dtype": "float32",
        "statistic": (
            f"best of {args.rounds} interleaved rounds, each the median of one "
            "torch.utils.benchmark blocked_autorange after warm-up"
        ),
        "rows": rows,
        "table": table,
        "provenance": provenance(ROOT),
    }
    out = output_path(args.out, args.publish, "copy_bench.json", ROOT)
    write_json(out, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
