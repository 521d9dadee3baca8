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
from .recorder import ACTIVATIONS, CATEGORIES, GRADIENTS, OPTIMIZER, OPTIMIZER_TEMP, PARAMS
from .trace import StepTrace, Workload, trace_step

__all__ = ["PHASES", "Plan", "make_plan", "stage_plan"]

PHASES = ("forward", "backward", "optimizer")
TRACED_DEPTH = 3
_BLOCK_INDEX = re.compile(r"(^|\.)\d+(?=\.|$)")
# Under CPU offload these live on the host (the optimizer steps there too).
HOST_CATEGORIES = frozenset({PARAMS, GRADIENTS, OPTIMIZER, OPTIMIZER_TEMP})


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
    timeline: list[int] = field(default_factory=list, repr=False)
    phase_starts: list[tuple[int, str]] = field(default_factory=list, repr=False)
    timeline_phases: list[str] = field(default_factory=list, repr=False)  # each point's
    # Pipeline parallel: this stage's index, and every traced stage's plan (this one
    # among them), first to last; see [Note: plan pipeline stages].
    stage_index: int | None = None
    stage_blocks: list[int] = field(default_factory=list)  # every stage's, first to last
    pipeline: tuple[int, int, str] | None = None  # (stages, microbatches, schedule)
    world_size: int = 1
    most_activations: int = 0  # the most activations alive at once (microbatches in flight)
    stages: list[Plan] = field(default_factory=list, repr=False, compare=False)
    # CPU offload: the sharded parameters, gradients and optimizer state (and the
    # optimizer step) live on the host; the peaks count the device only.
    offload: bool = False

    @property
    def peak_bytes(self) -> int:
        return self.phase_peaks[self.peak_phase]


def block_group(name: str) -> str:
    """A group's name with its block index as ``*``: ``layers.7`` -> ``layers.*``."""
    return _BLOCK_INDEX.sub(lambda m: f"{m.group(1)}*", name)


def _quantities(trace: StepTrace, offload: bool = False) -> dict[tuple, int]:
    """Everything a plan reports of one trace, flat, for extrapolation."""
    recorder = trace.recorder
    flat: dict[tuple, int] = {
        ("params",): trace.params_bytes, ("optimizer",): trace.optimizer_bytes,
        ("gradients",): trace.gradient_bytes, ("flops",): trace.flops,
        ("baseline",): trace.baseline_bytes,
        ("most_activations",): recorder.most_alive(ACTIVATIONS),
    }
    if offload:
        device = recorder.peaks_without(set(HOST_CATEGORIES))
        for phase in PHASES:
            peak, alive = device.get(phase, (0, {}))
            flat[("phase_peak", phase)] = peak
            for category, nbytes in alive.items():
                flat[("at_peak", phase, category)] = nbytes
    for phase in PHASES * (not offload):
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


def _plan_from(flat: dict[tuple, int], depth: int, traced: StepTrace,
               offload: bool = False) -> Plan:
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
                traced.recorder.timeline(HOST_CATEGORIES if offload else frozenset()),
                traced.recorder.phase_starts, traced.recorder.event_phases, offload=offload,
                most_activations=flat[("most_activations",)])


def extrapolate(shallow: StepTrace, deeper: StepTrace, depth: int,
                offload: bool = False) -> Plan:
    """The plan at ``depth`` blocks from traces one block apart (see
    [Note: plan extrapolation])."""
    if deeper.depth != shallow.depth + 1:
        raise ValueError(f"traces at depths {shallow.depth} and {deeper.depth}: extrapolation "
                         "needs two depths one block apart")
    low, high = _quantities(shallow, offload), _quantities(deeper, offload)
    flat = {key: high.get(key, 0) + (depth - deeper.depth) * (high.get(key, 0) - low.get(key, 0))
            for key in low.keys() | high.keys()}
    return _plan_from(flat, depth, deeper, offload)


def plan_of(trace: StepTrace, offload: bool = False) -> Plan:
    """The plan of one full-depth trace."""
    return _plan_from(_quantities(trace, offload), trace.depth, trace, offload)


def make_plan(source: ModelSource, world_size: int, settings: ShardSettings,
              workload: Workload, *, full_trace: bool = False) -> Plan:
    """Traces ``source``'s step on ``world_size`` fake ranks and plans it at its depth.

    Args:
        source: the model.
        world_size: ranks in all (data parallel (x replicas) x ``settings.tp`` x
            ``settings.pp``).
        settings: the parallelism set-up.
        workload: batch, sequence length, optimizer.
        full_trace: trace every block instead of extrapolating from 2 and 3.

    Returns:
        The plan of rank 0 (every rank alike); with ``settings.pp > 1``, the plan of the
        stage with the highest peak, every traced stage's in its ``stages``.
    """
    if settings.pp == 1:
        return _plan_at(source, source.depth, world_size, settings, workload, full_trace)
    if source.stage_blocks is None:
        raise NotImplementedError(f"--pp: {source.name} has no pipeline split here; plan "
                                  "--model transformer or llama3-* with --pp")
    traced = sorted({0, min(1, settings.pp - 1), settings.pp - 1})
    stages = [stage_plan(source, index, world_size, settings, workload, full_trace=full_trace)
              for index in traced]
    for plan in stages:
        plan.stages = stages
    return max(stages, key=lambda plan: plan.peak_bytes)


def stage_plan(source: ModelSource, stage_index: int, world_size: int,
               settings: ShardSettings, workload: Workload, *,
               full_trace: bool = False) -> Plan:
    """The plan of pipeline stage ``stage_index`` of ``settings.pp`` (see [Note: plan
    pipeline stages] in :mod:`.pipeline`); arguments as :func:`make_plan`'s."""
    depth = source.stage_blocks(settings.pp)[stage_index]
    return _plan_at(source, depth, world_size, settings, workload, full_trace, stage_index)


def _plan_at(source: ModelSource, depth: int, world_size: int, settings: ShardSettings,
             workload: Workload, full_trace: bool, stage_index: int | None = None) -> Plan:
    """The plan of the model (or of one pipeline stage) with ``depth`` blocks."""
    def trace(blocks: int) -> StepTrace:
        return trace_step(source, blocks, world_size, settings, workload, stage_index)

    # A pipeline stage's backward peak moves to its final place from 3 blocks on (with
    # 2, the first microbatch's backward peaks elsewhere): stages trace 3 and 4.
    deepest = TRACED_DEPTH if stage_index is None else TRACED_DEPTH + 1
    if full_trace or not source.extrapolable or depth <= deepest:
        plan = plan_of(trace(depth), settings.offload)
    else:
        plan = extrapolate(trace(deepest - 1), trace(deepest), depth, settings.offload)
    plan.world_size = world_size
    if stage_index is not None:
        plan.stage_index, plan.stage_blocks = stage_index, source.stage_blocks(settings.pp)
        plan.pipeline = (settings.pp, settings.n_microbatches, settings.schedule)
    return plan
