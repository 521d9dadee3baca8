"""Patch of how Dynamo traces an ``autograd.Function``'s forward: outputs a Function
declares fresh are not compared with every input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from .wrapping import wrap_once

FRESH_OUTPUTS = "_fsdp_traceable_fresh_outputs"

_F = TypeVar("_F", bound=Callable[..., Any])


def fresh_outputs(forward: _F) -> _F:
    """Marks an ``autograd.Function``'s ``forward`` as returning only new tensors, never
    one of its inputs (nor a tensor it marks dirty): see :func:`trust_fresh_outputs`."""
    setattr(forward, FRESH_OUTPUTS, True)
    return forward


def trust_fresh_outputs() -> bool:
    """Dynamo skips the input-identity checks of a forward marked :func:`fresh_outputs`.

    Dynamo traces every ``autograd.Function`` forward through a Python copy of what
    autograd does in C++ (``DynamoAutogradFunctionTraceHelper.fwd_trace_helper``): each
    output returned as is from the inputs becomes a view. Since torch 2.12 it finds
    those by comparing every output with every input (and every dirty tensor),
    ``O(outputs * inputs)`` traced bytecodes per call: about 2,500 for a parameter group
    of 9 parameters, a fifth of what Dynamo traces per block of a whole step (2.11 looks
    the outputs up in a set of the inputs: linear, 32 bytecodes per tensor). A forward
    whose outputs are all new tensors (the group's all-gather outputs) needs none of
    it; its outputs are returned as it returns them. Any other forward is traced by
    torch's own helper, unchanged.

    Applies to: every torch with that helper (2.11 to 2.14).

    Returns:
        Whether the helper is wrapped (``False`` where torch has none).
    """
    try:
        from torch._functorch.autograd_function import DynamoAutogradFunctionTraceHelper
    except ImportError:
        return False

    def trust(current: Callable[..., Any]) -> Callable[..., Any]:
        def fwd_trace_helper(orig_fwd: Callable[..., Any]) -> Callable[..., Any]:
            if not getattr(orig_fwd, FRESH_OUTPUTS, False):
                return current(orig_fwd)

            def inner(*args: Any, **kwargs: Any) -> Any:
                with torch.no_grad():
                    return orig_fwd(*args, **kwargs)

            return inner

        return fwd_trace_helper

    return wrap_once(DynamoAutogradFunctionTraceHelper, "fwd_trace_helper",
                     "_fsdp_traceable_trusts", trust)
