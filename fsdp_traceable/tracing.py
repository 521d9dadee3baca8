"""The one answer to "is this code being traced right now?" (and to "is an eager
backward running?", which the eager paths ask).

The collectives take functional collectives and the copies take traceable kernels
while Dynamo, compiled autograd, AOTAutograd or ``make_fx`` trace them, and their
eager implementations (c10d work, data pointers, ``out=`` buffers) otherwise.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch._subclasses.fake_tensor import is_fake
from torch._subclasses.functional_tensor import FunctionalTensor

from . import config


def is_tracing(tensors: Sequence[torch.Tensor] = ()) -> bool:
    """Whether a compiler is tracing this call: Dynamo is compiling, a proxy
    (``make_fx``) mode is active, or any of ``tensors`` is a fake or functional tensor
    (no data to read)."""
    if torch.compiler.is_compiling():
        return True
    if torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None:
        return True
    return any(is_fake(t) or isinstance(t, FunctionalTensor) for t in tensors)


_F = TypeVar("_F", bound=Callable[..., Any])


def in_backward() -> bool:
    """Whether an eager autograd backward is running on this thread (its graph task)."""
    return torch._C._current_graph_task_id() != -1


def constant_result(fn: _F) -> _F:
    """``torch._dynamo.assume_constant_result(fn)`` without importing Dynamo (about a
    second, and Inductor and Triton with it): that decorator only marks ``fn``, and
    Dynamo reads the mark when it traces a call (``tests/test_import_side_effects.py``
    checks both mark alike)."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@constant_result
def compiled_autograd_tracing() -> bool:
    """Whether compiled autograd's graph is being compiled (or run) now: Dynamo traces
    the eager hooks it captured, such as the re-gather of an eager forward's saved
    parameters (``torch._dynamo.compiled_autograd.in_compiled_autograd_region``; read
    without importing Dynamo, ``False`` where this torch has no such flag)."""
    module = sys.modules.get("torch._dynamo.compiled_autograd")
    return bool(getattr(module, "in_compiled_autograd_region", False))


def _reuse_by_key() -> bool:
    region = getattr(torch.compiler, "nested_compile_region", None)
    if region is None or "reuse_hash_fn" not in inspect.signature(region).parameters:
        return False
    # torch 2.12 has the key, but its Dynamo fails to flatten a keyed region's module
    # argument (NotImplementedError in tree_flatten).
    return torch.torch_version.TorchVersion(torch.__version__) >= (2, 13)


# Read once: Dynamo cannot trace inspect.signature where forward_regions_in_use runs.
_REGIONS_AVAILABLE = _reuse_by_key()


def regions_available() -> bool:
    """Whether this torch's ``nested_compile_region`` reuses a region by key (2.13 on)."""
    return _REGIONS_AVAILABLE


def keyed_region(body: Callable[..., Any]) -> Callable[..., Any] | None:
    """``body`` as a ``torch.compiler.nested_compile_region`` whose calls share a trace
    when their first argument, an int key, is equal; ``None`` where torch's regions
    take no key (:func:`regions_available`)."""
    if not regions_available():
        return None
    return torch.compiler.nested_compile_region(body, reuse_hash_fn=_key_of)


def _key_of(key: int, *_: Any) -> int:
    return key


def forward_regions_enabled() -> bool:
    """Whether whole steps run ``fully_shard`` forwards as nested compile regions:
    ``config.forward_regions`` is ``True``, or ``None`` (the default) on a torch whose
    regions take a reuse key."""
    return config.forward_regions is True or (
        config.forward_regions is None and regions_available())


def forward_regions_in_use() -> bool:
    """Whether ``fully_shard`` forwards run as nested compile regions now: a whole step
    is being traced (Dynamo traces ``backward()`` itself) with forward regions enabled
    (:func:`forward_regions_enabled`). See [Note: forward regions]."""
    # The cheap checks first: Dynamo traces this per block of a per-block compiled
    # backward, where trace_autograd_ops is off and no further frame is needed.
    return (torch.compiler.is_compiling()
            and getattr(torch._dynamo.config, "trace_autograd_ops", False)
            and forward_regions_enabled() and _REGIONS_AVAILABLE)


def compiled_autograd_regions_in_use() -> bool:
    """Whether Dynamo traces compiled autograd's graph now with ``config.backward_regions``
    on: each block's backward is one region call, and the re-gathers and reduce-scatters
    of the eager hooks compiled autograd captured run their copies as region calls too
    (see [Note: copy regions])."""
    return (config.backward_regions and torch.compiler.is_compiling()
            and compiled_autograd_tracing() and _REGIONS_AVAILABLE)


def copy_regions_in_use() -> bool:
    """Whether a bucket's all-gather copies run as calls of nested compile regions, one
    per layout (see [Note: copy regions]): where a whole step traces its forwards as
    regions (:func:`forward_regions_in_use`) or compiled autograd's graph is traced with
    backward regions (:func:`compiled_autograd_regions_in_use`)."""
    return forward_regions_in_use() or compiled_autograd_regions_in_use()
