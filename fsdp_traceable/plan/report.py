"""A plan as a terminal table or as JSON."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from .extrapolate import Plan
from .gpus import GPUS, collective_seconds
from .recorder import ACTIVATIONS, GRADIENTS, OPTIMIZER, PARAMS, UNSHARDED

__all__ = ["GIB", "format_plan", "host_bytes", "plan_json"]

GIB = 1024**3
_KINDS = ("all-gather", "reduce-scatter", "all-reduce", "send", "recv")


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
    bubble = 0.0
    if plan.pipeline is not None:
        stages, microbatches, _ = plan.pipeline
        bubble = compute * (stages - 1) / microbatches
    fsdp = tensor_parallel = pipeline = 0.0
    for (kind, group, _, ranks), (count, nbytes) in plan.collectives.items():
        if kind in ("send", "recv"):
            # P2P between stages: the ranks one stage apart, world / P.
            stride = plan.world_size // plan.pipeline[0] if plan.pipeline else 1
            pipeline += collective_seconds(gpu, kind, nbytes, stride)
            continue
        seconds = collective_seconds(gpu, kind, nbytes, ranks)
        if group.startswith("tensor parallel"):
            tensor_parallel += seconds
        else:
            fsdp += seconds
    exposed = max(0.0, fsdp + pipeline - compute) + tensor_parallel
    return {"compute_s": compute, "pipeline_bubble_s": bubble, "fsdp_comm_s": fsdp,
            "pipeline_comm_s": pipeline, "tensor_parallel_comm_s": tensor_parallel,
            "exposed_comm_s": exposed, "step_s": compute + bubble + exposed}


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
    if plan.offload:
        data["memory_per_rank_bytes"]["on_host"] = host_bytes(plan)
    if plan.pipeline is not None:
        stages, microbatches, schedule = plan.pipeline
        data["pipeline"] = {
            "stages": stages, "microbatches": microbatches, "schedule": schedule,
            "stage": plan.stage_index, "blocks_per_stage": plan.stage_blocks,
            "traced_stages": [_stage_row(stage) for stage in plan.stages],
        }
    if gpu is not None:
        data["estimate"] = {"gpu": gpu, **step_time(plan, gpu)}
    return data


def host_bytes(plan: Plan) -> int:
    """Under CPU offload: the sharded state on the host."""
    return plan.params_bytes + plan.gradient_bytes + plan.optimizer_bytes


def in_flight(plan: Plan) -> int:
    """Microbatches whose activations a stage holds at once: 1F1B runs ``P - s``
    forwards on stage ``s`` before its first backward, GPipe all of them."""
    stages, microbatches, schedule = plan.pipeline
    if schedule == "gpipe":
        return microbatches
    return min(stages - plan.stage_index, microbatches)


def _stage_row(plan: Plan) -> dict[str, Any]:
    p2p = {kind: sum(n for (k, _, _, _), (_, n) in plan.collectives.items() if k == kind)
           for kind in ("send", "recv")}
    return {"stage": plan.stage_index, "blocks": plan.stage_blocks[plan.stage_index],
            "microbatches_in_flight": in_flight(plan), "parameters": plan.params_bytes,
            "gradients": plan.gradient_bytes, "optimizer_state": plan.optimizer_bytes,
            "activations_in_flight": plan.most_activations,
            "activations_at_peak": plan.at_peak.get(ACTIVATIONS, 0), "peak": plan.peak_bytes,
            "peak_phase": plan.peak_phase, "send_bytes": p2p["send"],
            "recv_bytes": p2p["recv"]}


def _pipeline_lines(plan: Plan) -> list[str]:
    stages, microbatches, schedule = plan.pipeline
    lines = [
        f"pipeline: {stages} stages of {plan.stage_blocks} blocks, {schedule} over "
        f"{microbatches} microbatches; stage {plan.stage_index} (the highest peak of the "
        "traced stages) below",
        f"  {'stage':>5s} {'blocks':>6s} {'in flight':>9s} {'params+grads+optim':>20s} "
        f"{'activations':>14s} {'peak':>14s} {'send/step':>14s} {'recv/step':>14s}",
        "  (activations: the most alive at once, the microbatches in flight)",
    ]
    for row in (_stage_row(stage) for stage in plan.stages):
        state = row["parameters"] + row["gradients"] + row["optimizer_state"]
        lines.append(
            f"  {row['stage']:5d} {row['blocks']:6d} {row['microbatches_in_flight']:9d} "
            f"{_gib(state):>20s} {_gib(row['activations_in_flight']):>14s} "
            f"{_gib(row['peak']):>14s} {_gib(row['send_bytes']):>14s} "
            f"{_gib(row['recv_bytes']):>14s}")
    return [*lines, ""]


def method(plan: Plan) -> str:
    if plan.stage_index is not None:
        if len(plan.traced_depths) == 1:
            return "traced each stage's full step on fake tensors"
        low, high = plan.traced_depths
        return (f"traced each stage's step at {low} and {high} blocks on fake tensors and "
                "extrapolated linearly to the stage's identical blocks")
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
    host = "  (on the host)" if plan.offload else ""
    lines = [
        "plan: " + ", ".join(f"{k} {v}" for k, v in setup.items()),
        f"method: {method(plan)}",
        "",
        *(_pipeline_lines(plan) if plan.pipeline is not None else []),
        "memory per rank" + (f" (CPU offload: {_gib(host_bytes(plan)).strip()} of sharded "
                             "state on the host, where the optimizer steps; the peak counts "
                             "the device)" if plan.offload else ""),
        f"  parameters (sharded)            {_gib(plan.params_bytes)}{host}",
        f"  gradients (sharded)             {_gib(plan.gradient_bytes)}{host}",
        f"  optimizer state                 {_gib(plan.optimizer_bytes)}{host}",
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
        pipeline = (f", pipeline bubble {t['pipeline_bubble_s'] * 1e3:.1f} ms, send/recv "
                    f"{t['pipeline_comm_s'] * 1e3:.1f} ms" if plan.pipeline else "")
        lines.append(
            f"estimated step on {gpu} (peak FLOPs, ring collectives, FSDP overlapped; a "
            f"lower bound): compute {t['compute_s'] * 1e3:.1f} ms{pipeline}, FSDP comm "
            f"{t['fsdp_comm_s'] * 1e3:.1f} ms, TP comm {t['tensor_parallel_comm_s'] * 1e3:.1f} "
            f"ms, step {t['step_s'] * 1e3:.1f} ms; HBM {GPUS[gpu].hbm_bytes / GIB:.0f} GiB")
    return "\n".join(lines)
