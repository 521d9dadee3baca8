"""What Dynamo compiled while a block ran: frames, recompiles, graph breaks and
compiled-autograd captures, read from torch's own records (``counters``, Dynamo's
compilation metrics, the ``graph_breaks`` log)."""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from torch._dynamo.utils import (
    counters,
    get_compilation_metrics,
    set_compilation_metrics_limit,
)

__all__ = ["CompileRecord", "FrameCompile", "GraphBreaks", "track_compiles"]

_GRAPH_BREAK_LOG = "torch._dynamo.symbolic_convert.__graph_breaks"
_BREAK_LOCATION = re.compile(r"in user code at (.+?):(\d+)")
_METRICS_LIMIT = 4096


@dataclass(frozen=True)
class GraphBreaks:
    """Graph breaks: ``count``, one ``reasons`` entry per break (Dynamo's message), and
    the ``file:line`` of each break as Dynamo logged it (``locations``, the same order
    when the log accounts for every counted break).

    Unpacks as ``count, reasons``.
    """

    count: int
    reasons: list[str]
    locations: list[str] = field(default_factory=list)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.count, self.reasons))

    def summaries(self) -> list[str]:
        """The first line of each reason (e.g. ``"Unsupported Tensor.backward() call"``)."""
        return [reason.splitlines()[0] for reason in self.reasons]


@dataclass(frozen=True)
class FrameCompile:
    """One Dynamo frame compile: the code object, its compile id (``"frame/attempt"``,
    attempt > 0 for a recompile), and why it recompiled, if it did."""

    name: str
    filename: str
    compile_id: str
    recompile_reason: str | None

    @property
    def is_recompile(self) -> bool:
        """Whether Dynamo compiled this code object again because guards failed."""
        return self.recompile_reason is not None


@dataclass
class CompileRecord:
    """What compiled while a :func:`track_compiles` block ran (filled in at its exit).

    ``frames``: every Dynamo frame compile. ``graph_breaks``: every graph break.
    ``compiled_autograd_captures``: backward graphs compiled autograd captured (a
    cache miss each); ``compiled_autograd_captured_before``: whether it had captured
    any before the block (since Dynamo's counters were last cleared).
    """

    frames: list[FrameCompile] = field(default_factory=list)
    graph_breaks: GraphBreaks = field(default_factory=lambda: GraphBreaks(0, []))
    compiled_autograd_captures: int = 0
    compiled_autograd_captured_before: bool = False

    @property
    def recompiles(self) -> list[FrameCompile]:
        """The frame compiles that were recompiles, with their reasons."""
        return [frame for frame in self.frames if frame.is_recompile]

    def frames_named(self, name: str) -> list[FrameCompile]:
        """The compiles of code objects called ``name`` (e.g. ``"forward"``)."""
        return [frame for frame in self.frames if frame.name == name]


class _GraphBreakLocations(logging.Handler):
    """Collects ``(file:line, message)`` of each graph break Dynamo logs, in order."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        match = _BREAK_LOCATION.search(message)
        if match:
            self.records.append((f"{match.group(1)}:{match.group(2)}", message))


def _ordered_breaks(new_breaks: Counter, logged: list[tuple[str, str]]) -> GraphBreaks:
    """Pairs each counted break with its logged location, in the order they happened;
    falls back to the counters' order if the log does not account for every break."""
    paired = [(next((r for r in new_breaks if r in message), None), location)
              for location, message in logged]
    # Dynamo also logs frames it gave up on and ran eagerly without counting a break
    # (torch 2.14: the stdlib ``inspect`` frames that torch.compile of compiled
    # autograd's graph runs inside a captured backward); they match no counted reason.
    paired = [(reason, location) for reason, location in paired if reason is not None]
    if Counter(reason for reason, _ in paired) == new_breaks:
        return GraphBreaks(len(paired), [r for r, _ in paired], [loc for _, loc in paired])
    reasons = [reason for reason, n in new_breaks.items() for _ in range(n)]
    return GraphBreaks(len(reasons), reasons, [location for location, _ in logged])


@contextlib.contextmanager
def _graph_break_locations() -> Iterator[_GraphBreakLocations]:
    logger = logging.getLogger(_GRAPH_BREAK_LOG)
    handler = _GraphBreakLocations()
    saved = logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # keep the records off stderr
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved[0])
        logger.propagate = saved[1]


@contextlib.contextmanager
def track_compiles() -> Iterator[CompileRecord]:
    """Records every Dynamo compile, graph break and compiled-autograd capture in the block.

    Yields:
        A :class:`CompileRecord`, complete once the block exits.
    """
    record = CompileRecord()
    set_compilation_metrics_limit(max(_METRICS_LIMIT, len(get_compilation_metrics())))
    metrics_before = {id(m) for m in get_compilation_metrics()}
    breaks_before = Counter(counters["graph_break"])
    captures_before = counters["compiled_autograd"]["captures"]
    try:
        with _graph_break_locations() as locations:
            yield record
    finally:
        for metric in get_compilation_metrics():
            if id(metric) in metrics_before or metric.co_name is None:
                continue
            record.frames.append(FrameCompile(
                metric.co_name, metric.co_filename or "", str(metric.compile_id),
                metric.recompile_reason,
            ))
        new_breaks = Counter(counters["graph_break"]) - breaks_before
        record.graph_breaks = _ordered_breaks(new_breaks, locations.records)
        record.compiled_autograd_captures = counters["compiled_autograd"]["captures"] - captures_before
        record.compiled_autograd_captured_before = captures_before > 0
