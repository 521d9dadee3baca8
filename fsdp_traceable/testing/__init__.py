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
:func:`fake_process_group` (torch's fake process group, which ``explain`` compiles on)
and :mod:`.local_ranks` hold the process-group set-ups for single-process graph tests
and for real gloo ranks.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.fx

from ..introspection.compiles import CompileRecord, FrameCompile, GraphBreaks, track_compiles
from ..introspection.fake_world import fake_process_group
from ..introspection.graph import collective_kinds
from ..introspection.inductor_code import schedule

__all__ = [
    "CompileRecord",
    "FrameCompile",
    "GraphBreaks",
    "assert_no_recompiles",
    "count_collectives",
    "count_graph_breaks",
    "fake_process_group",
    "track_compiles",
]


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
