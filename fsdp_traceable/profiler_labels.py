"""Profiler labels for the eager path's phases: ``fsdp_traceable::<phase> (<module>)``.

FSDP2 runs each phase under ``torch.profiler.record_function("FSDP::<phase>")``, so a
trace reads like the algorithm; the eager path here does the same with its own
prefix. The phases (see ``docs/design.md``): ``pre_forward``, ``all_gather`` (copy-in
and collective), ``all_gather_copy_out`` (wait and copy-out), ``post_forward``,
``reshard``, ``pre_backward``, ``post_backward``, ``reduce_scatter`` (copy-in and
collective), ``reduce_scatter_wait``, ``all_reduce`` (HSDP), ``root_post_backward``
(the end-of-backward callback that finishes the reductions).

[Note: profiler labels are eager only]
A label is a ``record_function`` range only when nothing traces the call and a
profiler is running; otherwise :func:`phase` returns a null context, so compiled
graphs hold no profiler op (their phases show up as the kernels Inductor names) and
an eager step without a profiler pays one check per phase.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .tracing import is_tracing

PREFIX = "fsdp_traceable::"

_Method = TypeVar("_Method", bound=Callable[..., Any])


def label(name: str, module: str = "") -> str:
    """The label of phase ``name`` for the group of ``module`` (its path under the
    root; ``""`` for the root's group or for phases of no one group)."""
    return f"{PREFIX}{name} ({module})" if module else f"{PREFIX}{name}"


def phase(name: str, module: str = "") -> contextlib.AbstractContextManager:
    """A profiler range for phase ``name`` (see [Note: profiler labels are eager only]).

    Args:
        name: the phase, e.g. ``"all_gather"``.
        module: the path of the group's module under the root, shown after the phase.
    """
    # is_compiling first: under Dynamo it is a constant and nothing after it is traced
    # (reading the profiler flag there would guard on it); then the cheap flag, so an
    # unprofiled eager call stops there; then the other tracers (make_fx, fake tensors).
    if (torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled
            or is_tracing()):
        return contextlib.nullcontext()
    return torch.profiler.record_function(label(name, module))


def labelled(name: str) -> Callable[[_Method], _Method]:
    """Runs a parameter group's method as phase ``name``, labelled with the group's
    ``name`` (its module's path): ``@labelled("pre_forward")``."""
    def decorate(method: _Method) -> _Method:
        @functools.wraps(method)
        def run(group: Any, *args: Any, **kwargs: Any) -> Any:
            # The checks of phase() that end an unprofiled or traced call, without
            # entering a null context on every call of a hot method.
            if torch.compiler.is_compiling() or not torch.autograd.profiler._is_profiler_enabled:
                return method(group, *args, **kwargs)
            with phase(name, group.name):
                return method(group, *args, **kwargs)

        return run  # type: ignore[return-value]

    return decorate
