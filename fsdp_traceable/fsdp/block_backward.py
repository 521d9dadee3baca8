"""Which AOT backwards compiled autograd pastes as one region call: those of one
``fully_shard`` block compiled on its own (per-block compile).

A model compiled whole has one backward holding every group's reduce-scatter (and
every re-gather); it is pasted once and left as it is. A block's own backward is
pasted once per block: outlined, every block calls the one region
(:mod:`fsdp_traceable.backward_regions`). Two kinds of block backward:

- ``block.compile()`` after ``fully_shard`` compiles the block's compute alone (see
  [Note: per-module compile]): its backward has no collective, so it is known by its
  compiled function, recorded while Dynamo compiles that compute
  (:func:`call_compiled_compute`);
- a block compiled before ``fully_shard`` (or ``torch.compile(block)``) traces its
  group's collectives: its backward holds its own group's reduce-scatter and
  re-gather only. On one rank there is no reduce-scatter (the reduction is the
  identity), so the re-gather alone tells.

The hook is process-wide and judges a compiled function once, for every model that
runs it (identical blocks of two models share Dynamo's compiled code), so it reads the
process-group names of every live group; each group is held weakly and its name goes
with it, as do the recorded compiled functions. See [Note: per-model state] in
:mod:`.root_state`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary, WeakSet

import torch
import torch.distributed as dist
import torch.fx as fx

from .. import backward_regions
from ..collectives import comm

_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# Every live fully_shard group -> the name of the process group it reduce-scatters and
# all-gathers over.
_shard_group_names: WeakKeyDictionary[object, str] = WeakKeyDictionary()


class _ComputeCompiles:
    """The AOT compiled functions (``CompiledFunction`` classes) created while Dynamo
    compiled a per-module compiled compute: found as the ``autograd.Function``
    subclasses that appeared during that compile (Dynamo's compile callbacks)."""

    def __init__(self) -> None:
        self.compiled_functions: WeakSet[type] = WeakSet()
        self._calls_running = 0
        self._before: set[type] | None = None

    def _install(self) -> None:
        # Checked on every call: torch._dynamo.reset() clears the callbacks.
        handler = torch._dynamo.callback.callback_handler
        if self._on_compile_start not in handler.start_callbacks:
            handler.register_start_callback(self._on_compile_start)
            handler.register_end_callback(self._on_compile_end)

    def call(self, compiled: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self._install()
        self._calls_running += 1
        try:
            return compiled(*args, **kwargs)
        finally:
            self._calls_running -= 1

    def _on_compile_start(self, *_: Any) -> None:
        if self._calls_running:
            self._before = set(torch.autograd.Function.__subclasses__())

    def _on_compile_end(self, *_: Any) -> None:
        before, self._before = self._before, None
        if before is not None:
            self.compiled_functions.update(
                cls for cls in torch.autograd.Function.__subclasses__()
                if cls not in before and cls.__name__ == "CompiledFunction")


_compute_compiles = _ComputeCompiles()


def call_compiled_compute(compiled: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``compiled(*args, **kwargs)``, a module's compiled compute (``FSDPModule.compile``);
    a compile it triggers records its compiled functions, whose backwards
    :func:`is_one_block_backward` (installed by :func:`track_group` for every group)
    then picks."""
    return _compute_compiles.call(compiled, args, kwargs)


def track_group(group: object, shard_group: dist.ProcessGroup) -> None:
    """Marks ``shard_group``'s reduce-scatters as fully_shard's while ``group`` (a
    parameter group) lives, and makes sure compiled autograd outlines one-group
    backwards."""
    _shard_group_names[group] = comm.group_name(shard_group)
    backward_regions.install(is_one_block_backward)


def is_one_block_backward(compiled_function: type, bw_module: fx.GraphModule) -> bool:
    """Whether ``bw_module`` is one block's backward: that of a per-module compiled
    compute, or one that reduce-scatters or re-gathers for one fully_shard group (at
    most one of each, on a fully_shard shard group, and at least one)."""
    if compiled_function in _compute_compiles.compiled_functions:
        return True
    counts = {_REDUCE_SCATTER: 0, _ALL_GATHER: 0}
    shard_group_names = set(_shard_group_names.values())
    for node in bw_module.graph.nodes:
        if node.op == "call_function" and node.target in counts:
            group = node.args[-1]
            # A group name, or (torch 2.13+) a graph input holding the group object.
            if isinstance(group, fx.Node) or group in shard_group_names:
                counts[node.target] += 1
    return max(counts.values()) == 1
