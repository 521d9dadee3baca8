"""The plan of a training workload next to a run of it: planned peak memory and step
time (``python -m fsdp_traceable plan --json``) against what ``python -m
fsdp_traceable bench`` measured for one of its modes (``bench.json``).

The peak compared is what the step allocates above its start (the bench measures
``max_memory_allocated() - memory_allocated()`` around a step on CUDA, the profiler's
allocation events on CPU; the plan's ``peak - step_start``), so the sharded state alive
before the step counts in neither. The step time compared is the plan's ``--gpu``
estimate against the bench's median step; without ``--gpu`` in the plan, time is left
out.

``make gpu-check`` runs it on the GPU bench's workload (``benchmarks/gpu_check.sh``).

Usage::

    python benchmarks/plan_vs_run.py --plan plan.json --bench bench/bench.json \
        [--mode eager] [--out F | --publish]
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from fsdp_traceable.cli.bench_output import add_output_arguments, output_path, provenance, write_json


def compare(plan: dict[str, Any], bench: dict[str, Any], mode: str) -> dict[str, Any]:
    """Planned against measured peak (above the step's start) and step time.

    Args:
        plan: ``plan --json``'s report.
        bench: ``bench``'s ``bench.json``.
        mode: the bench mode the plan models (``eager``: ours, eagerly).

    Returns:
        Both figures of each and their ratio (planned / measured), with what was
        compared.
    """
    if mode not in bench["modes"]:
        raise ValueError(f"bench.json has no mode {mode!r}; it has {sorted(bench['modes'])}")
    measured = bench["modes"][mode]
    memory = plan["memory_per_rank_bytes"]
    planned_peak = memory["peak"] - memory["step_start"]
    report: dict[str, Any] = {
        "mode": mode,
        "plan_setup": plan["setup"],
        "bench_args": bench.get("args"),
        "bench_provenance": bench.get("provenance"),
        "peak_above_step_start_bytes": {
            "planned": planned_peak, "measured": measured["peak_bytes"],
            "ratio": planned_peak / measured["peak_bytes"]},
    }
    estimate = plan.get("estimate")
    if estimate is not None:
        planned_ms, measured_ms = estimate["step_s"] * 1e3, measured["median_step_ms"]
        report["step_ms"] = {"gpu": estimate["gpu"], "planned": planned_ms,
                             "measured": measured_ms, "ratio": planned_ms / measured_ms}
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--plan", required=True, help="plan --json output")
    parser.add_argument("--bench", required=True, help="bench's bench.json")
    parser.add_argument("--mode", default="eager", help="the bench mode to compare with")
    add_output_arguments(parser, "plan_vs_run.json")
    args = parser.parse_args(argv)
    with open(args.plan) as f:
        plan = json.load(f)
    with open(args.bench) as f:
        bench = json.load(f)
    report = {**compare(plan, bench, args.mode), "provenance": provenance()}
    peak = report["peak_above_step_start_bytes"]
    print(f"peak above the step's start: planned {peak['planned'] / 2**20:.1f} MiB, "
          f"measured {peak['measured'] / 2**20:.1f} MiB ({peak['ratio']:.2f}x)")
    if "step_ms" in report:
        step = report["step_ms"]
        print(f"step ({step['gpu']}): planned {step['planned']:.1f} ms, measured "
              f"{step['measured']:.1f} ms ({step['ratio']:.2f}x)")
    path = output_path(args.out, args.publish, "plan_vs_run.json")
    write_json(path, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
