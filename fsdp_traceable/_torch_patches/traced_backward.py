"""Dynamo's trace of ``backward()`` into tensor-subclass parameters, on torch 2.11."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .wrapping import wrap_once


def dynamo_traces_backward() -> bool:
    """Whether this torch's Dynamo traces ``backward()`` (``trace_autograd_ops``: 2.11+)."""
    return hasattr(torch._dynamo.config, "trace_autograd_ops")


def _collect_module() -> Any | None:
    """Dynamo's module holding ``_collect_tensors_with_sources``, where this torch traces
    ``backward()`` with it; else ``None``."""
    if not dynamo_traces_backward():
        return None
    from torch._dynamo.variables import torch as torch_variables

    if getattr(torch_variables, "_collect_tensors_with_sources", None) is None:
        return None
    return torch_variables


def subclass_patch_needed() -> bool:
    """Whether this torch's ``backward()`` handler rejects tensor subclasses, as 2.11's
    ``_collect_tensors_with_sources`` does (judged on torch's own function, so still
    ``True`` once :func:`trace_backward_into_subclasses` wrapped it)."""
    module = _collect_module()
    if module is None:
        return False
    collect = getattr(module._collect_tensors_with_sources, "__wrapped__",
                      module._collect_tensors_with_sources)
    return "is_traceable_wrapper_subclass" not in collect.__code__.co_names


def trace_backward_into_subclasses() -> bool:
    """Dynamo traces ``loss.backward()`` into DTensor parameters on torch 2.11 as 2.12 does.

    With ``torch._dynamo.config.trace_autograd_ops``, Dynamo traces ``backward()`` as a
    ``torch.autograd.grad`` call over the leaves it differentiates, after checking that
    no path from the loss leaves the graph. Torch 2.11 collects those tensors with
    ``_collect_tensors_with_sources``, which asserts each is a plain fake tensor, so a
    step over ``fully_shard``'s DTensor parameters fails in Dynamo with an
    ``AssertionError``. Torch 2.12 accepts a traceable wrapper subclass whose inner
    tensors are fake and keeps the subclass for the reachability check, whose own
    helper (``_collect_all_grad_fns``) unwraps subclasses on 2.11 already. The wrapper
    does just that for a subclass and hands every other argument to torch's function
    (whose recursion into lists comes back through the wrapper).

    Applies to: torch 2.11 (``_collect_tensors_with_sources`` without subclass
    support). Torch 2.12 to 2.14 need nothing.

    Returns:
        Whether the wrapper is in place (``False`` where torch has no such function
        rejecting subclasses).
    """
    if not subclass_patch_needed():
        return False
    module = _collect_module()
    from torch._dynamo.variables.tensor import TensorVariable
    from torch._subclasses.fake_tensor import FakeTensor, get_plain_tensors
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    def take_subclasses(current: Callable[..., Any]) -> Callable[..., Any]:
        def _collect_tensors_with_sources(var: Any) -> list[tuple[torch.Tensor, str | None]]:
            if isinstance(var, TensorVariable):
                value = var.as_proxy().node.meta.get("example_value")
                if is_traceable_wrapper_subclass(value):
                    plain: list[object] = []
                    get_plain_tensors(value, out=plain)
                    if all(isinstance(t, FakeTensor) for t in plain if isinstance(t, torch.Tensor)):
                        return [(value, var.source.name if var.source else None)]
            return current(var)

        return _collect_tensors_with_sources

    return wrap_once(module, "_collect_tensors_with_sources",
                     "_fsdp_traceable_takes_subclasses", take_subclasses)
