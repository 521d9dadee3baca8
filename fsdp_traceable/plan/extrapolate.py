"""A plan at the model's real depth from two shallow traces.

[Note: plan extrapolation]
A decoder's blocks are identical: each adds the same parameters, optimizer state,
gradients, activations and collectives to a step, and the embedding and output add the
same at any depth. Every quantity a plan reports is therefore linear in the depth
``D``: ``q(D) = q(b) + (D - b) * (q(b) - q(b - 1))``, from traces at ``b - 1`` and
``b`` blocks (``b = 3``: the middle block of three stands for every inner block).
Peaks are taken per phase (forward, backward, optimizer): within one phase the peak
falls at the same point of the step at any depth (e.g. the start of backward, when
every block's activations are alive), so each phase's peak, and what is alive at it,
is linear too; the step's peak is the largest. ``tests/plan`` checks this against a
full trace at a larger depth, exactly. Models whose blocks are not known to be
identical (``module:function``) are traced at full depth.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field

from .models import ModelSource, ShardSettings
from .recorder import CATEGORIES
from .trace import StepTrace, Workload, trace_step

__all__ = ["PHASES", "Plan", "make_plan"]

PHASES = ("forward", "backward", "optimizer")
TRACED_DEPTH = 3
_BLOCK_INDEX = re.compile(r"(^|\.)\d+(?=\.|$)")


@dataclass
class Plan:
    """A step's per-rank memory and per-step communication at the model's depth.

    Attributes:
        depth: blocks of the model.
        traced_depths: the depths actually traced (one: the full model).
        params_bytes, optimizer_bytes, gradient_bytes: persistent per-rank state (the
            gradients while the step holds them).
        phase_peaks: phase -> peak bytes alive on the rank during it.
        at_peak: category -> bytes alive at the step's peak.
        peak_phase: the phase of the step's peak.
        collectives: ``(kind, group, phase, ranks)`` -> ``[count, bytes]``; ``group``
            with block indices as ``*`` (every block's together).
        flops: forward + backward FLOPs on the rank.
        baseline_bytes: alive on the rank when a step starts (parameters, optimizer
            state, buffers, the batch).
    """

    depth: int
    traced_depths: tuple[int, ...]
    params_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    phase_peaks: dict[str, int]
    at_peak: dict[str, int]
    peak_phase: str
    collectives: dict[tuple[str, str, str, int], list[int]] = field(default_factory=dict)
    flops: int = 0
    baseline_bytes: int = 0
    # The deepest traced step's memory over time and phase starts, for a plot.
    timeline: list[int] = field(default_factory=list)
    phase_starts: list[tuple[int, str]] = field(default_factory=list)

    @property
    def peak_bytes(self) -> int:
        return self.phase_peaks[self.peak_phase]


def block_group(name: str) -> str:
    """A group's name with its block index as ``*``: ``layers.7`` -> ``layers.*``."""
    return _BLOCK_INDEX.sub(lambda m: f"{m.group(1)}*", name)


def _quantities(trace: StepTrace) -> dict[tuple, int]:
    """Everything a plan reports of one trace, flat, for extrapolation."""
    recorder = trace.recorder
    flat: dict[tuple, int] = {
        ("params",): trace.params_bytes, ("optimizer",): trace.optimizer_bytes,
        ("gradients",): trace.gradient_bytes, ("flops",): trace.flops,
        ("baseline",): trace.baseline_bytes,
    }
    for phase in PHASES:
        flat[("phase_peak", phase)] = recorder.phase_peaks.get(phase, 0)
        for category, nbytes in recorder.alive_at_peak(phase).items():
            flat[("at_peak", phase, category)] = nbytes
    counts: Counter = Counter()
    for c in recorder.collectives:
        key = (c.kind, block_group(c.group), c.phase, c.ranks)
        counts[("collective_count", *key)] += 1
        counts[("collective_bytes", *key)] += c.nbytes
    flat.update(counts)
    return flat


def _plan_from(flat: dict[tuple, int], depth: int, traced: StepTrace) -> Plan:
    phase_peaks = {phase: flat.get(("phase_peak", phase), 0) for phase in PHASES}
    peak_phase = max(PHASES, key=lambda p: phase_peaks[p])
    at_peak = {c: flat.get(("at_peak", peak_phase, c), 0) for c in CATEGORIES}
    collectives: dict[tuple[str, str, str, int], list[int]] = {}
    for key, value in flat.items():
        if key[0] == "collective_count" and value:
            collectives[key[1:]] = [value, flat[("collective_bytes", *key[1:])]]
    depths = (traced.depth,) if traced.depth == depth else (traced.depth - 1, traced.depth)
    return Plan(depth, depths, flat[("params",)], flat[("optimizer",)], flat[("gradients",)],
                phase_peaks, {c: n for c, n in at_peak.items() if n}, peak_phase,
                dict(sorted(collectives.items())), flat[("flops",)], flat[("baseline",)],
                traced.recorder.timeline(), traced.recorder.phase_starts)


def extrapolate(shallow: StepTrace, deeper: StepTrace, depth: int) -> Plan:
    """The plan at ``depth`` blocks from traces one block apart (see
    [Note: plan extrapolation])."""
    if deeper.depth != shallow.depth + 1:
        raise ValueError(f"traces at depths {shallow.depth} and {deeper.depth}: extrapolation "
                         "needs two depths one block apart")
    low, high = _quantities(shallow), _quantities(deeper)
    flat = {key: high.get(key, 0) + (depth - deeper.depth) * (high.get(key, 0) - low.get(key, 0))
            for key in low.keys() | high.keys()}
    return _plan_from(flat, depth, deeper)


def plan_of(trace: StepTrace) -> Plan:
    """The plan of one full-depth trace."""
    return _plan_from(_quantities(trace), trace.depth, trace)


def make_plan(source: ModelSource, world_size: int, settings: ShardSettings,
              workload: Workload, *, full_trace: bool = False) -> Plan:
    """Traces ``source``'s step on ``world_size`` fake ranks and plans it at its depth.

    Args:
        source: the model.
        world_size: ranks in all (data parallel times ``settings.tp``).
        settings: the parallelism set-up.
        workload: batch, sequence length, optimizer.
        full_trace: trace every block instead of extrapolating from 2 and 3.

    Returns:
        The plan of rank 0 (every rank alike).
    """
    if full_trace or not source.extrapolable or source.depth <= TRACED_DEPTH:
        return plan_of(trace_step(source, source.depth, world_size, settings, workload))
    shallow = trace_step(source, TRACED_DEPTH - 1, world_size, settings, workload)
    deeper = trace_step(source, TRACED_DEPTH, world_size, settings, workload)
    return extrapolate(shallow, deeper, source.depth)
