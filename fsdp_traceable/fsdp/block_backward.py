"""Which AOT backwards compiled autograd pastes as one region call: those of one
``fully_shard`` group, i.e. of a block compiled on its own (per-block compile).

A model compiled whole has one backward holding every group's reduce-scatter (and
every re-gather); it is pasted once and left as it is. A per-block compiled block's
backward holds its own group's reduce-scatter and re-gather only, and is pasted once
per block: outlined, every block calls the one region
(:mod:`fsdp_traceable.backward_regions`). On one rank there is no reduce-scatter
(the reduction is the identity), so the re-gather alone tells.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from .. import backward_regions
from ..collectives import comm

_REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
_ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
# The process-group names fully_shard groups reduce-scatter and all-gather over.
_shard_group_names: set[str] = set()


def register(shard_group: dist.ProcessGroup) -> None:
    """Marks ``shard_group``'s reduce-scatters as fully_shard's, and makes sure
    compiled autograd outlines one-group backwards."""
    _shard_group_names.add(comm.group_name(shard_group))
    backward_regions.install(is_one_group_backward)


def is_one_group_backward(bw_module: fx.GraphModule) -> bool:
    """Whether ``bw_module`` reduce-scatters or re-gathers for one fully_shard group:
    at most one of each, on a fully_shard shard group, and at least one."""
    counts = {_REDUCE_SCATTER: 0, _ALL_GATHER: 0}
    for node in bw_module.graph.nodes:
        if node.op == "call_function" and node.target in counts:
            group = node.args[-1]
            # A group name, or (torch 2.13+) a graph input holding the group object.
            if isinstance(group, fx.Node) or group in _shard_group_names:
                counts[node.target] += 1
    return max(counts.values()) == 1
