"""Peak memory of a step: host memory from the profiler's allocation events, GPU
memory from the device allocator's peak counter."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_allocated_bytes(step: Callable[[], object], device: str = "cpu") -> int:
    """Peak bytes allocated while ``step`` runs, counted from zero at its start: on
    CPU all threads' allocations (CPU allocator), on CUDA the caching allocator's.

    Args:
        step: the code to measure.
        device: ``"cpu"`` or ``"cuda"``.

    Returns:
        The highest running total of allocations minus frees during ``step``.
    """
    if device == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start
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
