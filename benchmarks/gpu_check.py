"""Bandwidth and bitwise check of the copy kernels on one GPU (no collectives).

For buckets of 9 (a d=4096 transformer block, >= 64 MB per copy), 100 (>= 64 MB per
copy) and 1000 parameters sharded over a simulated world (rank 0's view), every
implementation of the three copies

* ``aten``: the ``torch.ops.fsdp_traceable`` op run eagerly (``torch.cat`` etc.),
* ``foreach``: ``fsdp_traceable.collectives.foreach_copies`` (``torch._foreach_copy_``, ...),
* ``inductor``: ``torch.compile`` of the aten op (Inductor's generated code),
* ``triton_tiles``: the ``triton_kernels`` tile kernels run eagerly,
* ``triton_tiles_compiled``: ``torch.compile`` of the same (one opaque op per copy)

is first compared bit for bit with ``aten`` (NaN payloads excepted), then timed:
kernel time from CUDA-graph replay (``triton.testing.do_bench_cudagraph``, no launch
overhead) gives the achieved bandwidth, eager time per call
(``triton.testing.do_bench``, launch overhead included) is shown next to it, and so
is the host time per call (calls queued without synchronising, so the GPU does not
hold the host back). The first call of each implementation is timed too: for
``triton_tiles`` it includes compiling the kernel (run ``gpu_check.sh``, which points
Triton and Inductor at empty caches), for the compiled ones the whole
``torch.compile``. The 1000-parameter bucket runs first, so its first call is the one
that compiles the tile kernel.

Bytes counted per call: copy-in reads every shard and writes the padded flat input;
copy-out reads and writes every unsharded element (padding is neither); the
reduce-scatter copy-in reads every gradient and writes the padded flat input.

Usage::

    python benchmarks/gpu_check.py [--peak-bandwidth 4.8e12] [--out benchmarks/out/gpu/gpu_check.json]
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
from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance
from fsdp_traceable.collectives import foreach_copies
from fsdp_traceable.collectives.shard_info import make_shard_info
from fsdp_traceable.sizes import flatten_sizes

# Peak HBM bandwidth by device name (bytes/s); H200 is the default.
PEAKS = {"H200": 4.8e12, "H100 PCIe": 2.0e12, "H100": 3.35e12}
DEFAULT_PEAK = PEAKS["H200"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMPLS = ("aten", "foreach", "inductor", "triton_tiles", "triton_tiles_compiled")
COMPILED = ("inductor", "triton_tiles_compiled")
HOST_CALLS = 20
OPS = ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")


def make_bucket(num_params: int, seed: int = 0, scale: int = 1) -> list[tuple[tuple[int, ...], int]]:
    """``(global_size, shard_dim)`` per parameter: a d=4096 transformer block (9), a
    mix of uneven matrices with some ``Shard(1)`` (100), or many small tensors (1000);
    ``scale`` divides the block's dims (for the CPU check of ``--dry-run``)."""
    if num_params == 9:
        # hidden is not divisible by 8: dim-0 padding
        d, hidden, kv = 4096 // scale, 10923 // scale, 1024 // scale
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
        from fsdp_traceable import triton_kernels

        targs = args[:-1] + ([2] * len(self.params),) if op == "all_gather_copy_out" else args

        def run():
            out = getattr(triton_kernels, op)(*targs)
            if op == "all_gather_copy_out":
                return triton_kernels.unsharded_views(out, self.sizes_flat, self.ndims, dtypes)
            return [out]

        if impl == "triton_tiles":
            return run
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
        torch.cuda.synchronize()
        start = time.perf_counter()
        outputs = fn()
        torch.cuda.synchronize()
        result["first_call_s"] = time.perf_counter() - start
        result["bitwise_equal"] = same_bits(outputs, reference)
        del outputs, reference
        result["host_us"] = host_us(fn)
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


def host_us(fn: Callable[[], list[torch.Tensor]]) -> float:
    """Host time per call: :data:`HOST_CALLS` calls queued back to back, timed before
    the synchronisation that waits for their kernels."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_CALLS):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / HOST_CALLS * 1e6


def peak_bandwidth(requested: float | None, device_name: str) -> tuple[float, str]:
    if requested is not None:
        return requested, "--peak-bandwidth"
    for name, peak in PEAKS.items():
        if name in device_name:
            return peak, f"default for {name}"
    return DEFAULT_PEAK, "H200 default; pass --peak-bandwidth for this device"


def _find(results: list[dict], op: str, n: int, impl: str) -> dict | None:
    return next((r for r in results if (r["op"], r["params"], r["impl"]) == (op, n, impl)), None)


def markdown(results: list[dict], buckets: list[int], cases: dict) -> str:
    """Two tables: bandwidth and per-call times, then first-call (compile) times."""
    head = "| op | params | MB | " + " | ".join(IMPLS) + " |"
    rule = "|---" * (len(IMPLS) + 3) + "|"
    lines, first = [head, rule], [head, rule]
    for op in OPS:
        for n in buckets:
            megabytes = f"{cases[n].bytes(op) / 1e6:.0f}" if n in cases else "?"
            row = f"| {op} | {n} | {megabytes} | "
            lines.append(row + " | ".join(_cell(_find(results, op, n, i)) for i in IMPLS) + " |")
            first.append(row + " | ".join(_first_call(_find(results, op, n, i)) for i in IMPLS) + " |")
    return "\n".join([
        *lines, "",
        "Cell: % of peak bandwidth (kernel µs from CUDA-graph replay; eager µs per call; host "
        "µs per call); `!=` marks output that is not bitwise equal to aten.", "",
        "First call, seconds (compiles included: the tile kernel's for the first "
        "`triton_tiles` bucket, `torch.compile` for the compiled columns):", "",
        *first,
    ])


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    flag = "" if r.get("bitwise_equal") else "!= "
    kernel = f"{r['kernel_us']:.0f}" if "kernel_us" in r else "n/a"
    return (f"{flag}{100 * r['fraction_of_peak']:.0f}% ({kernel}; {r['eager_us']:.0f}; "
            f"{r['host_us']:.0f})")


def _first_call(r: dict | None) -> str:
    return f"{r['first_call_s']:.2f}" if r and "first_call_s" in r else "-"


def dry_run(args, buckets: list[int]) -> tuple[list[dict], dict]:
    """CPU-only: builds every bucket and the layouts and tile tables of its three
    copies, and checks the eager implementations bit for bit on a small 9-parameter
    bucket (the Triton kernels in the interpreter)."""
    from fsdp_traceable.triton_kernels import layout

    small = Case(make_bucket(9, scale=32), args.world_size, "cpu")
    results = []
    for op in OPS:
        reference = small.call(op, "aten")()
        for impl in ("foreach", "triton_tiles"):
            results.append({"op": op, "params": 9, "impl": impl, "scale": 32,
                            "bitwise_equal": same_bits(small.call(op, impl)(), reference),
                            "skipped": "dry run: unmeasured"})
    cases = {}
    for n in buckets:
        case = cases[n] = Case(make_bucket(n), args.world_size, "cpu", materialize=False)
        kinds = (0,) * n
        numels = tuple(math.prod(s) for s in case.sharded_sizes)
        sizes = tuple(s for s, _ in case.params)
        start = time.perf_counter()
        gather = layout.gather_layout(numels, tuple(case.padded), kinds)
        chunks = layout.chunk_layout(sizes, tuple(case.dims), args.world_size, kinds)
        out = layout.chunk_layout(sizes, tuple(case.dims), args.world_size, (3,) * n, out_align=8)
        tables = [gather.pack_tiles, chunks.pack_tiles, out.unpack_tiles]
        build_s = time.perf_counter() - start
        assert gather.row_numel == chunks.row_numel == case.row_numel
        for op in OPS:
            results.append({"op": op, "params": n, "impl": "-", "bytes": case.bytes(op),
                            "tiles": [len(t) // 2 for t in tables], "layout_build_s": build_s,
                            "skipped": "dry run: unmeasured"})
    return results, cases


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-bandwidth", type=float, default=None,
                        help="peak memory bandwidth in bytes/s (default: by device name, H200 4.8e12)")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--buckets", default="9,100,1000")
    parser.add_argument("--time-budget", type=float, default=240.0,
                        help="seconds after which remaining measurements are skipped")
    add_output_arguments(parser, os.path.join("gpu", "gpu_check.json"))
    parser.add_argument("--dry-run", action="store_true", help="build buckets and kernels only (CPU)")
    args = parser.parse_args(argv)
    args.out = str(output_path(args.out, args.publish, os.path.join("gpu", "gpu_check.json"), ROOT))
    buckets = [int(b) for b in args.buckets.split(",")]

    if args.dry_run:
        device_name, (peak, source) = "none (dry run)", peak_bandwidth(args.peak_bandwidth, "")
        results, cases = dry_run(args, buckets)
    else:
        if not torch.cuda.is_available():
            parser.error("no CUDA device; use --dry-run on CPU")
        device_name = torch.cuda.get_device_name()
        peak, source = peak_bandwidth(args.peak_bandwidth, device_name)
        results = []
        start = time.monotonic()
        cases = {n: Case(make_bucket(n), args.world_size, "cuda") for n in buckets}
        # Eager implementations first (fast), largest bucket count first (its first call
        # compiles the tile kernel); compiled ones last (compile time), the tile op first.
        order = [(impl, n) for impl in IMPLS if impl not in COMPILED
                 for n in sorted(buckets, reverse=True)]
        order += [(impl, n) for n in buckets for impl in reversed(COMPILED)]
        for impl, n in order:
            for op in OPS:
                if time.monotonic() - start > args.time_budget:
                    results.append({"op": op, "params": n, "impl": impl, "skipped": "time budget"})
                    continue
                results.append({**measure(cases[n], op, impl, peak), "params": n})
                print(f"[{time.monotonic() - start:6.1f}s] {op} {n} {impl}: {_cell(results[-1])}", flush=True)
    print(f"device: {device_name}; world size {args.world_size} (simulated, rank 0); "
          f"peak bandwidth {peak:.3g} B/s ({source})")
    print(markdown(results, buckets, cases))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": device_name, "peak_bandwidth": peak, "peak_source": source,
                   "world_size": args.world_size, "measured": not args.dry_run,
                   "results": results, "provenance": provenance(ROOT)}, f, indent=1)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
