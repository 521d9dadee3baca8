"""Peak memory of a step: host memory from the profiler's allocation events, GPU
memory from the device allocator's peak counter."""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch.profiler import ProfilerActivity, profile

# A host allocation of this many bytes, made by the caller just before the step, tells
# the caller's profiler thread id apart from the process group's worker threads.
_MARKER_BYTES = 7919
# A line kineto writes when a profiler starts or stops: "USDT:<date> <time> <pid>:<tid>
# SyncActivityProfilerHandler.cpp:52] profiler_start" (and STAGE: lines like it).
_KINETO_MARK = re.compile(rb"(USDT|STAGE):\S+ \S+ \d+:\d+ \w+\.cpp:\d+\] ")


@contextmanager
def _without_kineto_marks() -> Iterator[None]:
    """Runs the body with file descriptor 2 sent to a temporary file, then writes back
    to standard error every line but kineto's own marks.

    Starting and stopping torch's profiler makes kineto write ``STAGE:... Completed
    Stage`` and ``USDT:... profiler_start`` / ``profiler_stop`` lines straight to file
    descriptor 2, whatever ``KINETO_LOG_LEVEL`` says: a dozen lines per measured mode
    of ``bench``. Only this module's own start and stop calls are wrapped; anything
    else written meanwhile (another thread's output) is written back after them.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            kept = [line for line in captured.read().splitlines(keepends=True)
                    if not _KINETO_MARK.match(line)]
            if kept:
                os.write(2, b"".join(kept))


def peak_allocated_bytes(step: Callable[[], object], device: str = "cpu",
                         caller_thread_only: bool = False) -> int:
    """Peak bytes allocated while ``step`` runs, counted from zero at its start: on
    CPU all threads' allocations (CPU allocator), on CUDA the caching allocator's.

    Args:
        step: the code to measure.
        device: ``"cpu"`` or ``"cuda"``.
        caller_thread_only: on CPU, count only allocations and frees made on the
            calling thread (autograd's CPU backward runs there too), leaving out the
            process group's own worker threads. Gloo's threads allocate and free
            scratch buffers of a collective's size; when they free them relative to the
            caller's allocations is a race, so two libraries are compared fairly
            without them.

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
    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _without_kineto_marks():
        prof.start()
    try:
        marker = torch.empty(_MARKER_BYTES, dtype=torch.uint8)
        step()
        del marker
    finally:
        with _without_kineto_marks():
            prof.stop()
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
        key=lambda e: e.start_ns(),
    )
    marker_event = next(e for e in events if e.nbytes() == _MARKER_BYTES)
    caller = marker_event.start_thread_id()
    current = peak = 0
    for event in events:
        if caller_thread_only and event.start_thread_id() != caller:
            continue
        current += event.nbytes()
        peak = max(peak, current)
    return peak - _MARKER_BYTES
