"""Bandwidth and bitwise check of the copy kernels on one GPU (no collectives).

For buckets of 9, 100 and 1000 parameters sharded over a simulated world (rank 0's
view), every implementation of the three copies

* ``aten``: the ``torch.ops.fsdp_traceable`` op run eagerly (``torch.cat`` etc.),
* ``foreach``: ``fsdp_traceable.collectives.foreach_copies`` (``torch._foreach_copy_``, ...),
* ``inductor``: ``torch.compile`` of the aten op (Inductor's generated code),
* ``triton``: the ``fsdp_traceable_triton`` op run eagerly (table-driven kernel),
* ``triton_generated``: the per-bucket generated kernel (the traced path's) run eagerly,
* ``triton_compiled``: ``torch.compile`` of the ``fsdp_traceable_triton`` op

is first compared bit for bit with ``aten`` (NaN payloads excepted), then timed:
kernel time from CUDA-graph replay (``triton.testing.do_bench_cudagraph``, no launch
overhead) gives the achieved bandwidth, and eager time per call
(``triton.testing.do_bench``, launch overhead included) is shown next to it.

Bytes counted per call: copy-in reads every shard and writes the padded flat input;
copy-out reads and writes every unsharded element (padding is neither); the
reduce-scatter copy-in reads every gradient and writes the padded flat input.

Usage::

    python benchmarks/gpu_check.py [--peak-bandwidth 4.8e12] [--out benchmarks/results/gpu_check.json]
    python benchmarks/gpu_check.py --dry-run   # CPU: buckets, layouts, generated kernels

Stops measuring after ``--time-budget`` seconds (compiles of big buckets are slow)
and reports the rest as skipped.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable

import torch

import fsdp_traceable  # noqa: F401  (registers the ops)
from fsdp_traceable.collectives import foreach_copies
from fsdp_traceable.collectives.shard_info import make_shard_info
from fsdp_traceable.sizes import flatten_sizes

# Peak HBM bandwidth by device name (bytes/s); H200 is the default.
PEAKS = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}
DEFAULT_PEAK = PEAKS["H200"]
IMPLS = ("aten", "foreach", "inductor", "triton", "triton_generated", "triton_compiled")
OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")


def make_bucket(num_params: int, seed: int = 0, scale: int = 1) -> list[tuple[tuple[int, ...], int]]:
    """``(global_size, shard_dim)`` per parameter: a transformer block (9), a mix of
    uneven matrices with some ``Shard(1)`` (100), or many small tensors (1000);
    ``scale`` divides the block's dims (for the CPU check of ``--dry-run``)."""
    if num_params == 9:
        # hidden is not divisible by 8: dim-0 padding
        d, hidden, kv = 2048 // scale, 5462 // scale, 512 // scale
        return [((d,), 0), ((d, d), 0), ((kv, d), 0), ((kv, d), 0), ((d, d), 0),
                ((d,), 0), ((hidden, d), 0), ((d, hidden), 0), ((hidden, d), 0)]
    rng = random.Random(seed)
    params = []
    for i in range(num_params):
        if num_params >= 1000:
            size = (rng.randint(1, 8192),) if i % 2 else (rng.randint(1, 256), rng.choice([64, 128, 256]))
            params.append((size, 0))
        elif i % 10 == 9:
            params.append(((rng.randint(1, 2048), rng.choice([256, 1024, 2048])), 1))
        else:
            params.append(((rng.randint(1, 4096), rng.choice([256, 1024, 2048])), 0))
    return params


class Case:
    """One bucket's inputs for the three copies, on ``device``."""

    def __init__(self, params, world_size: int, device: str, materialize: bool = True):
        self.params, self.world = params, world_size
        self.sizes_flat, self.ndims = flatten_sizes([p[0] for p in params])
        self.dims = [p[1] for p in params]
        infos = [make_shard_info(s, world_size, 0, shard_dim=d) for s, d in params]
        self.padded = [i.padded_sharded_numel for i in infos]
        self.sharded_sizes = [i.sharded_size for i in infos]
        self.row_numel = sum(self.padded)
        self.numel = sum(math.prod(s) for s, _ in params)
        self.shard_numel = sum(math.prod(s) for s in self.sharded_sizes)
        if not materialize:
            return
        gen = torch.Generator(device=device).manual_seed(0)
        self.shards = [torch.randn(s, generator=gen, device=device) for s in self.sharded_sizes]
        specials = torch.tensor([float("nan"), float("inf"), -0.0, 1e-40, 65520.0, 1.00390625])
        first = self.shards[0].view(-1)
        n = min(first.numel(), specials.numel())
        first[:n] = specials[:n].to(device)
        gathered = torch.randn(world_size * self.row_numel, generator=gen, device=device)
        self.gathered = gathered.to(torch.bfloat16)
        self.grads = [torch.randn(s, generator=gen, device=device) for s, _ in params]

    def bytes(self, op: str) -> int:
        if op == "all_gather_copy_in":  # fp32 shards -> bf16 flat input
            return 4 * self.shard_numel + 2 * self.row_numel
        if op == "all_gather_copy_out":  # bf16 in, bf16 out
            return 2 * self.numel + 2 * self.numel
        return 4 * self.numel + 2 * self.world * self.row_numel  # fp32 grads -> bf16, divided

    def call(self, op: str, impl: str) -> Callable[[], list[torch.Tensor]]:
        """A closure running ``op`` with ``impl`` and returning its outputs as a list."""
        bf16 = torch.bfloat16
        dtypes = [bf16] * len(self.params)
        if op == "all_gather_copy_in":
            args = (self.shards, self.padded, bf16)
        elif op == "all_gather_copy_out":
            args = (self.gathered, self.world, self.sizes_flat, self.ndims, self.dims, dtypes)
        else:
            # 3 is not a power of two: CUDA's multiply-by-reciprocal rounding shows.
            args = (self.grads, self.world, self.dims, bf16, 3.0)
        aten = getattr(torch.ops.fsdp_traceable, op)
        if impl == "aten":
            return lambda: _as_list(aten(*args))
        if impl == "foreach":
            fn = getattr(foreach_copies, op)
            return lambda: _as_list(fn(*args))
        if impl == "inductor":
            compiled = torch.compile(lambda: aten(*args))
            return lambda: _as_list(compiled())
        import triton_kernels
        import triton_kernels.launch as launch

        triton_op = getattr(torch.ops.fsdp_traceable_triton, op)
        targs = args[:-1] + ([2] * len(self.params),) if op == "all_gather_copy_out" else args

        def run():
            out = triton_op(*targs)
            if op == "all_gather_copy_out":
                return triton_kernels.unsharded_views(out, self.sizes_flat, self.ndims, dtypes)
            return [out]

        if impl == "triton":
            return run
        if impl == "triton_generated":
            def generated():
                with launch.generated_kernels_in_eager():
                    return run()
            return generated
        compiled = torch.compile(run)
        return lambda: _as_list(compiled())


def _as_list(out) -> list[torch.Tensor]:
    return list(out) if isinstance(out, (list, tuple)) else [out]


def same_bits(actual: list[torch.Tensor], expected: list[torch.Tensor]) -> bool:
    if len(actual) != len(expected):
        return False
    for a, e in zip(actual, expected):
        if a.shape != e.shape or a.dtype != e.dtype:
            return False
        nan_a, nan_e = a.isnan(), e.isnan()
        ints = {2: torch.int16, 4: torch.int32}[a.element_size()]
        if not torch.equal(nan_a, nan_e) or not torch.equal(a[~nan_a].view(ints), e[~nan_e].view(ints)):
            return False
    return True


def measure(case: Case, op: str, impl: str, peak: float) -> dict:
    from triton.testing import do_bench, do_bench_cudagraph

    result: dict = {"op": op, "impl": impl, "bytes": case.bytes(op)}
    try:
        fn = case.call(op, impl)
        reference = case.call(op, "aten")()
        result["bitwise_equal"] = same_bits(fn(), reference)
        result["eager_us"] = do_bench(fn, return_mode="median") * 1e3
        try:
            result["kernel_us"] = do_bench_cudagraph(fn, return_mode="median") * 1e3
        except Exception as error:  # e.g. a host sync inside the capture
            result["kernel_error"] = repr(error)[:200]
        seconds = result.get("kernel_us", result["eager_us"]) * 1e-6
        result["bandwidth"] = result["bytes"] / seconds
        result["fraction_of_peak"] = result["bandwidth"] / peak
    except Exception as error:
        result["error"] = repr(error)[:300]
    return result


def peak_bandwidth(requested: float | None, device_name: str) -> tuple[float, str]:
    if requested is not None:
        return requested, "--peak-bandwidth"
    for name, peak in PEAKS.items():
        if name in device_name:
            return peak, f"default for {name}"
    return DEFAULT_PEAK, "H200 default; pass --peak-bandwidth for this device"


def markdown(results: list[dict], buckets: list[int]) -> str:
    lines = ["| op | params | " + " | ".join(IMPLS) + " |", "|---" * (len(IMPLS) + 2) + "|"]
    for op in OPS:
        for n in buckets:
            cells = []
            for impl in IMPLS:
                r = next((r for r in results if (r["op"], r["params"], r["impl"]) == (op, n, impl)), None)
                cells.append(_cell(r))
            lines.append(f"| {op} | {n} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Cell: % of peak bandwidth (kernel time from CUDA-graph replay, µs; eager µs per "
                 "call); `!=` marks output that is not bitwise equal to aten.")
    return "\n".join(lines)


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    flag = "" if r.get("bitwise_equal") else "!= "
    kernel = f"{r['kernel_us']:.0f}" if "kernel_us" in r else "n/a"
    return f"{flag}{100 * r['fraction_of_peak']:.0f}% ({kernel}; {r['eager_us']:.0f})"


def dry_run(args, buckets: list[int]) -> list[dict]:
    """CPU-only: builds every bucket, its three layouts and the generated kernels, and
    checks the eager implementations bit for bit on a small 9-parameter bucket (the
    Triton kernels in the interpreter)."""
    from triton_kernels import codegen, layout

    small = Case(make_bucket(9, scale=32), args.world_size, "cpu")
    results = []
    for op in OPS:
        reference = small.call(op, "aten")()
        for impl in ("foreach", "triton", "triton_generated"):
            results.append({"op": op, "params": 9, "impl": impl, "scale": 32,
                            "bitwise_equal": same_bits(small.call(op, impl)(), reference),
                            "skipped": "dry run: unmeasured"})
    for n in buckets:
        case = Case(make_bucket(n), args.world_size, "cpu", materialize=False)
        kinds = (0,) * n
        numels = tuple(math.prod(s) for s in case.sharded_sizes)
        gather = layout.gather_layout(numels, tuple(case.padded), kinds)
        sizes = tuple(s for s, _ in case.params)
        chunks = layout.chunk_layout(sizes, tuple(case.dims), args.world_size, kinds)
        assert gather.row_numel == chunks.row_numel == case.row_numel
        codegen.pack_kernel(gather, n, False, interpret=False)
        codegen.pack_kernel(chunks, n, False, interpret=False)
        codegen.unpack_kernel(layout.chunk_layout(sizes, tuple(case.dims), args.world_size,
                                                  (3,) * n, out_align=8), interpret=False)
        for op in OPS:
            results.append({"op": op, "params": n, "impl": "-", "bytes": case.bytes(op),
                            "blocks": chunks.num_blocks, "skipped": "dry run: unmeasured"})
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-bandwidth", type=float, default=None,
                        help="peak memory bandwidth in bytes/s (default: by device name, H200 4.8e12)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--buckets", default="9,100,1000")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds after which remaining measurements are skipped")
    parser.add_argument("--out", default=os.path.join("benchmarks", "results", "gpu_check.json"))
    parser.add_argument("--dry-run", action="store_true", help="build buckets and kernels only (CPU)")
    args = parser.parse_args(argv)
    buckets = [int(b) for b in args.buckets.split(",")]

    if args.dry_run:
        device_name, (peak, source) = "none (dry run)", peak_bandwidth(args.peak_bandwidth, "")
        results = dry_run(args, buckets)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device; use --dry-run on CPU")
        device_name = torch.cuda.get_device_name()
        peak, source = peak_bandwidth(args.peak_bandwidth, device_name)
        results = []
        start = time.monotonic()
        cases = {n: Case(make_bucket(n), args.world_size, "cuda") for n in buckets}
        # Eager implementations first (fast); compiled ones last (compile time).
        order = [(impl, n) for impl in IMPLS if "inductor" not in impl and "compiled" not in impl
                 for n in buckets] + [(impl, n) for n in buckets for impl in ("inductor", "triton_compiled")]
        for impl, n in order:
            for op in OPS:
                if time.monotonic() - start > args.time_budget:
                    results.append({"op": op, "params": n, "impl": impl, "skipped": "time budget"})
                    continue
                results.append({**measure(cases[n], op, impl, peak), "params": n})
                print(f"[{time.monotonic() - start:6.1f}s] {op} {n} {impl}: {_cell(results[-1])}", flush=True)
    print(f"device: {device_name}; world size {args.world_size} (simulated, rank 0); "
          f"peak bandwidth {peak:.3g} B/s ({source})")
    print(markdown(results, buckets))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": device_name, "peak_bandwidth": peak, "peak_source": source,
                   "world_size": args.world_size, "measured": not args.dry_run,
                   "results": results}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
