"""Which AOT backwards compiled autograd pastes as one region call: those of one
``fully_shard`` group, i.e. of a block compiled on its own (per-block compile).

A model compiled whole has one backward holding every group's reduce-scatter (and
every re-gather); it is pasted once and left as it is. A per-block compiled block's
backward holds its own group's reduce-scatter and re-gather only, and is pasted once
per block: outlined, every block calls the one region
(:mod:`fsdp_traceable.backward_regions`). On one rank there is no reduce-scatter
(the reduction is the identity), so the re-gather alone tells.

The hook is process-wide and judges a compiled function once, for every model that
runs it (identical blocks of two models share Dynamo's compiled code), so it reads the
process-group names of every live group; each group is held weakly and its name goes
with it. See [Note: per-model state] in :mod:`.root_state`.
"""

from __future__ import annotations

from weakref import WeakKeyDictionary

import torch
import torch.distributed as dist
import torch.fx as fx

from ... import backward_regions
from ...collectives import comm

_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# Every live fully_shard group -> the name of the process group it reduce-scatters and
# all-gathers over.
_shard_group_names: WeakKeyDictionary[object, str] = WeakKeyDictionary()


def track_group(group: object, shard_group: dist.ProcessGroup) -> None:
    """Marks ``shard_group``'s reduce-scatters as fully_shard's while ``group`` (a
    parameter group) lives, and makes sure compiled autograd outlines one-group
    backwards."""
    _shard_group_names[group] = comm.group_name(shard_group)
    backward_regions.install(is_one_group_backward)


def is_one_group_backward(bw_module: fx.GraphModule) -> bool:
    """Whether ``bw_module`` reduce-scatters or re-gathers for one fully_shard group:
    at most one of each, on a fully_shard shard group, and at least one."""
    counts = {_REDUCE_SCATTER: 0, _ALL_GATHER: 0}
    shard_group_names = set(_shard_group_names.values())
    for node in bw_module.graph.nodes:
        if node.op == "call_function" and node.target in counts:
            group = node.args[-1]
            # A group name, or (torch 2.13+) a graph input holding the group object.
            if isinstance(group, fx.Node) or group in shard_group_names:
                counts[node.target] += 1
    return max(counts.values()) == 1
