"""Helpers for pinning a compiled model's graph breaks, recompiles and collectives in a
test suite.

>>> with assert_no_recompiles():
...     for _ in range(10):
...         train_step()
>>> breaks = count_graph_breaks(compiled_step, tokens)
>>> assert breaks.count == 1, breaks.reasons
>>> count_collectives(graph_module)  # Counter({'all_gather': 3, 'wait': 3})

Everything here reads torch's own records (``torch._dynamo.utils.counters``, Dynamo's
compilation metrics, the ``graph_breaks`` log), so it sees every frame Dynamo compiles
while the block runs, including frames of library code it enters after a graph break.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch._dynamo.utils import counters, get_compilation_metrics, set_compilation_metrics_limit

from .graph_inspect import collective_kinds
from .inductor_code import schedule

__all__ = [
    "CompileRecord",
    "FrameCompile",
    "GraphBreaks",
    "assert_no_recompiles",
    "count_collectives",
    "count_graph_breaks",
    "track_compiles",
]

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


def count_graph_breaks(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> GraphBreaks:
    """Calls ``fn(*args, **kwargs)`` once and returns the graph breaks Dynamo hit.

    ``fn`` is typically a ``torch.compile``-d function or module; anything it runs that
    Dynamo compiles counts, including frames entered after a graph break.

    Args:
        fn: the callable to run.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        :class:`GraphBreaks` (unpacks as ``count, reasons``).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    with track_compiles() as record:
        fn(*args, **kwargs)
    return record.graph_breaks


@contextlib.contextmanager
def assert_no_recompiles(
    *, max_compiled_autograd_captures: int | None = None
) -> Iterator[CompileRecord]:
    """Fails if anything recompiles in the block, listing every recompile's reason.

    First compiles are fine, so the warm-up steps may run inside the block. A frame
    compiled again because its guards failed (another model of the same class, a
    changed grad mode, a new input shape without ``dynamic=True``) is a recompile.
    Compiled autograd has no guards: each backward graph it captures is a cache miss,
    limited by ``max_compiled_autograd_captures``.

    Args:
        max_compiled_autograd_captures: backward graphs compiled autograd may capture
            in the block. Default: 1 if it had captured none before the block (the
            first backward), else 0. Use 2 around gradient accumulation with warm-up:
            one graph assigns ``.grad``, one accumulates into it.

    Yields:
        The :class:`CompileRecord` of the block.

    Raises:
        AssertionError: at the end of the block, if anything recompiled.
    """
    limit = max_compiled_autograd_captures
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 0):
        raise ValueError(
            f"max_compiled_autograd_captures must be None or an int >= 0, got {limit!r}"
        )
    with track_compiles() as record:
        yield record
    if limit is None:
        limit = 0 if record.compiled_autograd_captured_before else 1
    problems = [
        f"{frame.name} ({frame.filename}) recompiled [{frame.compile_id}]: {frame.recompile_reason}"
        for frame in record.recompiles
    ]
    if record.compiled_autograd_captures > limit:
        problems.append(
            f"compiled autograd captured {record.compiled_autograd_captures} backward "
            f"graph(s); expected at most {limit}"
        )
    if problems:
        raise AssertionError("unexpected recompiles:\n" + "\n".join(problems))


def count_collectives(graph_or_code: torch.fx.GraphModule | torch.fx.Graph | str) -> Counter:
    """Counts the functional collectives in an FX graph or in Inductor output code.

    Args:
        graph_or_code: a ``GraphModule`` / ``Graph`` (nested subgraphs, such as the
            bodies of checkpoint or autograd-function ops, are counted too) or the
            generated Python code of an Inductor compile.

    Returns:
        A ``Counter`` keyed by ``"all_gather"``, ``"reduce_scatter"``,
        ``"all_reduce"``, ``"all_to_all"``, ``"broadcast"`` and ``"wait"``.
    """
    if isinstance(graph_or_code, str):
        return Counter(launch.kind for launch in schedule(graph_or_code)
                       if launch.kind not in ("kernel", "extern"))
    if isinstance(graph_or_code, torch.fx.Graph):
        if graph_or_code.owning_module is None:
            raise ValueError(
                "graph_or_code is a torch.fx.Graph without an owning GraphModule; pass the "
                "GraphModule so nested subgraphs can be found"
            )
        graph_or_code = graph_or_code.owning_module
    if not isinstance(graph_or_code, torch.fx.GraphModule):
        raise TypeError(
            "graph_or_code must be a torch.fx.GraphModule, a torch.fx.Graph or a code "
            f"string, got {type(graph_or_code).__name__}"
        )
    return collective_kinds(graph_or_code)
