"""The function calls Dynamo inlines while it traces: a count load does not change, and
the part of Dynamo's work that grows with what the traced code calls (each inlined call
is a frame Dynamo interprets bytecode by bytecode).

Compiled autograd's backward of a per-block compiled model traces the eager hooks of
every block (the saved tensors' unpack, the re-gather, the reduce-scatter), so their
calls per block are Dynamo's cost per block (``benchmarks/block_trace_count.py``).
"""

from __future__ import annotations

import contextlib
import pathlib
import time
from collections import Counter
from collections.abc import Iterator

__all__ = ["count_inlined_calls"]


@contextlib.contextmanager
def count_inlined_calls(outermost_seconds: Counter[str] | None = None) -> Iterator[Counter[str]]:
    """Counts every call Dynamo inlines while the block runs, by inlined function.

    Args:
        outermost_seconds: if given, also filled with the wall seconds Dynamo spends in
            each outermost inlined call (one the traced frame makes itself, e.g. compiled
            autograd's ``call_hook``), everything it inlines in turn included, by function.

    Yields:
        A counter, filled as Dynamo traces, of ``"qualified name (folder/file:line)"``
        per inlined call (``InliningInstructionTranslator.inline_call_``, torch 2.11 to
        2.15).
    """
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    counts: Counter[str] = Counter()
    original = InliningInstructionTranslator.inline_call_
    depth = 0

    def inline_call_(self):
        nonlocal depth
        code = self.f_code
        where = "/".join(pathlib.Path(code.co_filename).parts[-2:])
        name = f"{getattr(code, 'co_qualname', code.co_name)} ({where}:{code.co_firstlineno})"
        counts[name] += 1
        start = time.perf_counter()
        depth += 1
        try:
            return original(self)
        finally:
            depth -= 1
            if outermost_seconds is not None and depth == 0:
                outermost_seconds[name] += time.perf_counter() - start

    InliningInstructionTranslator.inline_call_ = inline_call_
    try:
        yield counts
    finally:
        InliningInstructionTranslator.inline_call_ = original
