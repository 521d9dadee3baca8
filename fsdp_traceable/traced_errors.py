"""Errors raised from code that Dynamo may be tracing, reported as written.

[Note: errors raised while Dynamo traces]
A ``raise`` in code Dynamo traces is traced too: Dynamo records it as an observed
exception, and under ``fullgraph=True`` reports ``Unsupported: Observed exception`` with
the package's message three paragraphs down, under "Developer debug context". A
function marked as a constant result is called for real while Dynamo traces, and
Dynamo passes a ``torch._dynamo.exc.Unsupported`` raised there on unchanged (torch
2.11 to 2.15): so the package raises an error that is both a ``NotImplementedError``
and an ``Unsupported`` there. Under ``fullgraph=True`` its message is the first line
the user reads; without it Dynamo graph-breaks, as it does at any ``Unsupported``, and
the code runs eagerly.

Nothing of Dynamo is imported unless Dynamo is already compiling.
"""

from __future__ import annotations

import functools
from typing import NoReturn

import torch

from .tracing import constant_result


def raise_not_implemented(message: str) -> NoReturn:
    """Raises ``NotImplementedError(message)``, also from code Dynamo traces (see
    [Note: errors raised while Dynamo traces]).

    Args:
        message: what is not supported and the fix; a constant while Dynamo traces (the
            string is handed to a function Dynamo calls for real).

    Raises:
        NotImplementedError: always; while Dynamo compiles, one that is also Dynamo's
            ``Unsupported``.
    """
    if torch.compiler.is_compiling():
        _raise_while_compiling(message)
    raise NotImplementedError(message)


@constant_result
def _raise_while_compiling(message: str) -> None:
    raise _not_implemented_while_compiling()(message)


@functools.cache
def _not_implemented_while_compiling() -> type[NotImplementedError]:
    from torch._dynamo.exc import Unsupported

    class NotImplementedWhileCompiling(NotImplementedError, Unsupported):
        """A ``NotImplementedError`` Dynamo passes on with its message unchanged."""

        def __init__(self, message: str) -> None:
            Unsupported.__init__(self, message, "fsdp_traceable: not implemented")

    NotImplementedWhileCompiling.__module__ = __name__
    return NotImplementedWhileCompiling
