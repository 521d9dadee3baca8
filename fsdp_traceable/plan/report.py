"""A plan as a terminal table or as JSON."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .extrapolate import Plan
from .gpus import GPUS, collective_seconds
from .recorder import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMS, UNSHARDED

__all__ = ["GIB", "format_plan", "plan_json"]

GIB = 1024**3
_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def _group_rows(plan: Plan) -> dict[str, dict[str, list[int]]]:
    """group -> kind -> [count, bytes], over the step's phases."""
    rows: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
    for (kind, group, _, _), (count, nbytes) in plan.collectives.items():
        rows[group][kind][0] += count
        rows[group][kind][1] += nbytes
    return rows


def step_time(plan: Plan, gpu_name: str) -> dict[str, float]:
    """The estimated step time on ``gpu_name`` (see :mod:`.gpus` for the model)."""
    gpu = GPUS[gpu_name]
    compute = plan.flops / gpu.bf16_flops
    fsdp = tensor_parallel = 0.0
    for (kind, group, _, ranks), (count, nbytes) in plan.collectives.items():
        seconds = collective_seconds(gpu, kind, nbytes, ranks)
        if group.startswith("tensor parallel"):
            tensor_parallel += seconds
        else:
            fsdp += seconds
    exposed = max(0.0, fsdp - compute) + tensor_parallel
    return {"compute_s": compute, "fsdp_comm_s": fsdp, "tensor_parallel_comm_s": tensor_parallel,
            "exposed_comm_s": exposed, "step_s": compute + exposed}


def plan_json(plan: Plan, setup: dict[str, Any], gpu: str | None = None) -> dict[str, Any]:
    """The plan as plain JSON data (bytes per rank, collectives per step)."""
    collectives = [
        {"kind": kind, "group": group, "phase": phase, "ranks": ranks, "count": count,
         "bytes": nbytes}
        for (kind, group, phase, ranks), (count, nbytes) in plan.collectives.items()
    ]
    totals = {kind: {"count": sum(c["count"] for c in collectives if c["kind"] == kind),
                     "bytes": sum(c["bytes"] for c in collectives if c["kind"] == kind)}
              for kind in _KINDS}
    data = {
        "setup": setup,
        "depth": plan.depth,
        "traced_depths": list(plan.traced_depths),
        "method": method(plan),
        "memory_per_rank_bytes": {
            "parameters": plan.params_bytes, "gradients": plan.gradient_bytes,
            "optimizer_state": plan.optimizer_bytes,
            "unsharded_parameters_at_peak": plan.at_peak.get(UNSHARDED, 0),
            "activations_at_peak": plan.at_peak.get(ACTIVATIONS, 0),
            "at_peak": plan.at_peak, "peak": plan.peak_bytes, "peak_phase": plan.peak_phase,
            "phase_peaks": plan.phase_peaks, "step_start": plan.baseline_bytes,
        },
        "collectives_per_step": collectives,
        "collective_totals": totals,
        "flops_per_rank": plan.flops,
    }
    if gpu is not None:
        data["estimate"] = {"gpu": gpu, **step_time(plan, gpu)}
    return data


def method(plan: Plan) -> str:
    if len(plan.traced_depths) == 1:
        return f"traced the full step ({plan.depth} blocks) on fake tensors"
    low, high = plan.traced_depths
    return (f"traced the step at {low} and {high} blocks on fake tensors and extrapolated "
            f"linearly to {plan.depth} identical blocks")


def _gib(nbytes: float) -> str:
    if nbytes < GIB:
        return f"{nbytes / 2**20:10.3f} MiB"
    return f"{nbytes / GIB:10.3f} GiB"


def format_plan(plan: Plan, setup: dict[str, Any], gpu: str | None = None) -> str:
    """The plan as a table for the terminal."""
    lines = [
        "plan: " + ", ".join(f"{k} {v}" for k, v in setup.items()),
        f"method: {method(plan)}",
        "",
        "memory per rank",
        f"  parameters (sharded)            {_gib(plan.params_bytes)}",
        f"  gradients (sharded)             {_gib(plan.gradient_bytes)}",
        f"  optimizer state                 {_gib(plan.optimizer_bytes)}",
        f"  unsharded parameters at peak    {_gib(plan.at_peak.get(UNSHARDED, 0))}",
        f"  activations at peak             {_gib(plan.at_peak.get(ACTIVATIONS, 0))}",
        f"  other at peak                   {_gib(sum(n for c, n in plan.at_peak.items() if c not in (PARAMS, OPTIMIZER, GRADIENTS, UNSHARDED, ACTIVATIONS)))}",  # noqa: E501
        f"  peak ({plan.peak_phase:9s})              {_gib(plan.peak_bytes)}",
        "",
        "collectives per step (bytes: the unsharded buffer; group '*': every block)",
        f"  {'group':34s} {'kind':15s} {'count':>7s} {'MiB':>16s}",
    ]
    totals: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for group, kinds in sorted(_group_rows(plan).items()):
        for kind in _KINDS:
            if kind in kinds:
                count, nbytes = kinds[kind]
                totals[kind][0] += count
                totals[kind][1] += nbytes
                lines.append(f"  {group:34s} {kind:15s} {count:7d} {nbytes / 2**20:16,.3f}")
    for kind in _KINDS:
        count, nbytes = totals.get(kind, (0, 0))
        lines.append(f"  {'total':34s} {kind:15s} {count:7d} {nbytes / 2**20:16,.3f}")
    lines.append(f"\nFLOPs per rank and step: {plan.flops:.3e}")
    if gpu is not None:
        t = step_time(plan, gpu)
        lines.append(
            f"estimated step on {gpu} (peak FLOPs, ring collectives, FSDP overlapped; a "
            f"lower bound): compute {t['compute_s'] * 1e3:.1f} ms, FSDP comm "
            f"{t['fsdp_comm_s'] * 1e3:.1f} ms, TP comm {t['tensor_parallel_comm_s'] * 1e3:.1f} "
            f"ms, step {t['step_s'] * 1e3:.1f} ms; HBM {GPUS[gpu].hbm_bytes / GIB:.0f} GiB")
    return "\n".join(lines)
