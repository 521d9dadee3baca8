"""Compiled copy-out of one all-gather bucket: the one-kernel ``cat`` form the library
compiles against the per-parameter ``split_with_sizes_copy`` form, and memcpy.

``all_gather_copy_out`` compiled alone with Inductor (fresh cache, world size 2, fp32)
returning every unsharded parameter:

* one kernel: the library's compiled decomposition, one buffer for the group written
  by a single kernel, the parameters views of it;
* per parameter: the same op with its compiled decomposition swapped for the eager
  one, ``split_with_sizes_copy``, which Inductor lowers to one copy per parameter (in
  a full model each is fused into the first kernel that reads the parameter);
* memcpy: ``clone`` of the all-gather output.

Both forms are checked to produce the same bits first. Prints a markdown table and
writes JSON (default ``benchmarks/out/compiled_copy_bench.json``; with ``--publish``,
``benchmarks/results/compiled_copy_bench.json``).

Run: ``python benchmarks/compiled_copy_bench.py``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import tempfile

import torch
from torch.utils import benchmark

import fsdp_traceable.collectives.ops as ops
from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json
from fsdp_traceable.sizes import flatten_sizes, padded_sharded_size

WORLD_SIZE = 2
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _block(dim: int, hidden: int) -> list[list[int]]:
    """A transformer block's parameters: attention, MLP and two norms."""
    return [[dim, dim]] * 4 + [[hidden, dim], [dim, hidden], [hidden, dim], [dim], [dim]]


WORKLOADS = {
    "transformer block, d=1024 (9 params)": _block(1024, 2816),
    "transformer block, d=256 (9 params)": _block(256, 688),
    "MLP, d=1024 (4 params)": [[4096, 1024], [1024, 4096], [1024], [1024]],
    "32 params of 64x96": [[64, 96]] * 32,
    "100 params of 17x13": [[17, 13]] * 100,
}


def _copy_out_fn(sizes: list[list[int]]):
    sizes_flat, ndims = flatten_sizes(sizes)
    n = len(sizes)

    def copy_out(all_gather_output: torch.Tensor) -> list[torch.Tensor]:
        return torch.ops.fsdp_traceable.all_gather_copy_out(
            all_gather_output, WORLD_SIZE, sizes_flat, ndims, [0] * n, [torch.float32] * n)

    return copy_out


def _all_gather_numel(sizes: list[list[int]]) -> int:
    """Elements of the bucket's all-gather output (every rank's padded shards)."""
    padded = [padded_sharded_size(size, 0, WORLD_SIZE) for size in sizes]
    return WORLD_SIZE * sum(torch.Size(size).numel() for size in padded)


def _compiled(sizes: list[list[int]], per_parameter: bool):
    torch._dynamo.reset()
    original = ops._param_major_copy_out
    if per_parameter:
        ops._param_major_copy_out = lambda rank_major, splits: torch.split_with_sizes_copy(
            rank_major, splits, dim=1)
    try:
        compiled = torch.compile(_copy_out_fn(sizes), fullgraph=True)
        compiled(torch.zeros(_all_gather_numel(sizes)))  # compiles with the form chosen above
    finally:
        ops._param_major_copy_out = original
    return compiled


def _time_us(fn, arg) -> float:
    timer = benchmark.Timer("fn(arg)", globals={"fn": fn, "arg": arg})
    return timer.blocked_autorange(min_run_time=1.0).median * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_output_arguments(parser, "compiled_copy_bench.json")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="compiled_copy_bench_")
    torch._inductor.config.force_disable_caches = True
    torch.manual_seed(0)
    rows = []
    for name, sizes in WORKLOADS.items():
        one_kernel, per_parameter = _compiled(sizes, False), _compiled(sizes, True)
        gathered = torch.randn(_all_gather_numel(sizes))
        for got, want in zip(one_kernel(gathered), per_parameter(gathered)):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        memcpy_us = _time_us(torch.clone, gathered)
        one_kernel_us, per_parameter_us = _time_us(one_kernel, gathered), _time_us(per_parameter, gathered)
        rows.append({"workload": name, "bytes": gathered.nbytes, "one_kernel_us": one_kernel_us,
                     "per_parameter_us": per_parameter_us, "memcpy_us": memcpy_us})
        print(f"{name}: one kernel {one_kernel_us:.1f} us, per parameter {per_parameter_us:.1f} us, "
              f"memcpy {memcpy_us:.1f} us", flush=True)
    print("\n| bucket | one kernel vs memcpy | per parameter vs memcpy | one kernel vs per parameter |")
    print("|---|---:|---:|---:|")
    for row in rows:
        print(f"| {row['workload']} | {row['one_kernel_us'] / row['memcpy_us']:.2f}x "
              f"| {row['per_parameter_us'] / row['memcpy_us']:.2f}x "
              f"| {row['one_kernel_us'] / row['per_parameter_us']:.2f}x |")
    result = {
        "date": datetime.date.today().isoformat(), "torch": torch.__version__,
        "machine": platform.machine(), "threads": torch.get_num_threads(),
        "world_size": WORLD_SIZE, "rows": rows, "provenance": provenance(ROOT),
    }
    out = output_path(args.out, args.publish, "compiled_copy_bench.json", ROOT)
    write_json(out, result)


if __name__ == "__main__":
    main()
