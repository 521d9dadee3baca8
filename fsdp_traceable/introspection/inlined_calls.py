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
from collections import Counter
from collections.abc import Iterator

__all__ = ["count_inlined_calls"]


@contextlib.contextmanager
def count_inlined_calls() -> Iterator[Counter[str]]:
    """Counts every call Dynamo inlines while the block runs, by inlined function.

    Yields:
        A counter, filled as Dynamo traces, of ``"qualified name (folder/file:line)"``
        per inlined call (``InliningInstructionTranslator.inline_call_``, torch 2.11 to
        2.15).
    """
    from torch._dynamo.symbolic_convert import InliningInstructionTranslator

    counts: Counter[str] = Counter()
    original = InliningInstructionTranslator.inline_call_

    def inline_call_(self):
        code = self.f_code
        where = "/".join(pathlib.Path(code.co_filename).parts[-2:])
        name = getattr(code, "co_qualname", code.co_name)
        counts[f"{name} ({where}:{code.co_firstlineno})"] += 1
        return original(self)

    InliningInstructionTranslator.inline_call_ = inline_call_
    try:
        yield counts
    finally:
        InliningInstructionTranslator.inline_call_ = original
