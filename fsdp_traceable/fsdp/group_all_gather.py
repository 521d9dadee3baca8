"""A group's all-gather, traced or eager: one bucketed collective over its parameters,
through their all-gather extensions where a parameter has one. When to gather is the
group's (:class:`~.param_group.ParamGroup`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ..collectives import comm, foreach_all_gather, foreach_all_gather_copy_out
from .features.all_gather_extensions import (
    PendingUnshard,
    all_gather_inputs,
    unsharded_from_outputs,
)

if TYPE_CHECKING:  # FSDP2's comm interface, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    from .param_shards import ParamShards


def start_all_gather(
    params: ParamShards,
    sharded_locals: list[torch.Tensor],
    *,
    streams: comm.DeviceStreams | None,
    all_gather_comm: AllGather | None,
    group: dist.ProcessGroup | None = None,
) -> PendingUnshard:
    """Starts the all-gather of ``params`` from their local shards.

    Args:
        params: the group's parameters.
        sharded_locals: their local shards (offloaded ones are copied to the device).
        streams: eager, the streams to run it on; ``None`` traced.
        all_gather_comm: a custom all-gather (eager), or ``None``.
        group: the ranks to gather over, the shard group by default (another: the first
            step of a two-step all-gather, see [Note: the post-forward piece, compiled]).

    Returns:
        The all-gather in flight; :func:`finish_all_gather` waits for it.
    """
    sharded_locals = params.on_device(sharded_locals)
    # Traced too: Dynamo guards on the hooks it finds, so hooks set later recompile.
    extensions = params.extensions
    # any() of the list, not all() of a generator, which Dynamo traces a frame per item.
    if not any(extensions):  # an AllGatherExtension is true
        result = foreach_all_gather(sharded_locals, params.infos, group or params.shard_group,
                                    streams=streams, all_gather_comm=all_gather_comm,
                                    check=False, layout=params.layout)
        return PendingUnshard(result, None)
    hook_inputs = all_gather_inputs(sharded_locals, params.infos, extensions)
    result = foreach_all_gather(hook_inputs.tensors, hook_inputs.infos, group or params.shard_group,
                                streams=streams, all_gather_comm=all_gather_comm)
    return PendingUnshard(result, hook_inputs)


def finish_all_gather(pending: PendingUnshard) -> list[torch.Tensor]:
    """Waits for the all-gather and returns the unsharded parameters (post hooks run)."""
    outputs = foreach_all_gather_copy_out(pending.result)
    if pending.hook_inputs is None:
        return outputs
    return unsharded_from_outputs(outputs, pending.hook_inputs)


def complete_all_gather(pending: PendingUnshard | None) -> None:
    """Completes an all-gather whose output is not wanted (every rank joined it)."""
    if pending is not None:
        foreach_all_gather_copy_out(pending.result)
