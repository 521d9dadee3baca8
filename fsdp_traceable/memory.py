"""Peak host memory of a step, from the profiler's allocation events."""

from __future__ import annotations

from collections.abc import Callable

from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(step: Callable[[], object]) -> int:
    """Peak bytes allocated (all threads, CPU allocator) while ``step`` runs, counted
    from zero at its start.

    Args:
        step: the code to measure.

    Returns:
        The highest running total of allocations minus frees during ``step``.
    """
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    current = peak = 0
    for event in events:
        current += event.nbytes()
        peak = max(peak, current)
    return peak
