"""Bucketed all-gather: :func:`foreach_all_gather` and :func:`foreach_all_gather_copy_out`.

FSDP2's ``foreach_all_gather`` on plain tensors plus
:class:`~fsdp_traceable.collectives.shard_info.ShardInfo` metadata instead of
``FSDPParam``: functional collectives while tracing, async c10d in eager (see
:mod:`~fsdp_traceable.collectives.comm`); the copies come from the backend
``config.copy_kernels`` picks, which all compute the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist

from ..tracing import copy_regions_in_use
from ..whole_step.copy_regions import copy_in_in_region, copy_out_in_region
from . import comm, copy_backends
from .bucket_layout import BucketLayout
from .shard_info import ShardInfo
from .validation import check_bucket, check_bucket_bytes

if TYPE_CHECKING:  # FSDP2's comm interface, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

__all__ = ["AllGatherResult", "all_gather_output_copy_out", "foreach_all_gather",
           "foreach_all_gather_copy_out"]


class AllGatherResult(NamedTuple):
    """An all-gather in flight; pass it to :func:`foreach_all_gather_copy_out`."""

    pending: comm.PendingTensor
    layout: BucketLayout
    streams: comm.DeviceStreams | None

    @property
    def infos(self) -> tuple[ShardInfo, ...]:
        """The gathered parameters' :class:`ShardInfo`, in bucket order."""
        return self.layout.infos


@torch.no_grad()
def foreach_all_gather(
    sharded_tensors: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    group: dist.ProcessGroup,
    *,
    streams: comm.DeviceStreams | None = None,
    all_gather_comm: AllGather | None = None,
    check: bool = True,
    layout: BucketLayout | None = None,
) -> AllGatherResult:
    """Copies this rank's shards into one buffer and starts one all-gather of it.

    Args:
        sharded_tensors: this rank's shards, ``info.sharded_size`` each (unpadded;
            the copy-in pads and casts to ``info.param_dtype``).
        infos: one :class:`ShardInfo` per shard.
        group: the shard process group.
        streams: eager-only copy-in stream holder for devices with streams.
        all_gather_comm: eager-only FSDP2 ``AllGather``: allocates the output buffer
            and runs the collective (default: ``torch.empty`` and c10d).
        check: validate the bucket against ``infos`` (``False``: the caller built
            both together and checked them once, as ``fully_shard``'s groups do).
        layout: ``BucketLayout.of(infos)``, where the caller keeps it (see
            [Note: bucket layouts]).

    Returns:
        The in-flight :class:`AllGatherResult`; compute may run before copy-out.
    """
    if check:
        check_bucket(sharded_tensors, infos, group, tensors_name="sharded_tensors",
                     expect="sharded")
        check_bucket_bytes(infos)
    if layout is None:
        layout = BucketLayout.of(infos)
    dtype = layout.all_gather_dtype
    padded_numels = layout.padded_sharded_numels
    traced = comm.use_traced_path()
    inputs = list(sharded_tensors)
    if dtype == torch.uint8:
        # The byte path reinterprets each shard as it is: cast to its param_dtype first.
        inputs = [t.to(param_dtype) for t, param_dtype in zip(inputs, layout.param_dtypes)]
    if traced:
        if all_gather_comm is not None:
            raise NotImplementedError(
                "a custom all-gather (set_custom_all_gather) runs eagerly only: a compiled "
                "graph all-gathers with functional collectives; unset it before compiling "
                "(set_symm_mem_for_comm and set_allocate_memory_from_process_group_for_comm "
                "set one too)"
            )
        if copy_regions_in_use():
            flat_input = copy_in_in_region(inputs, layout, dtype)
        else:
            flat_input = copy_backends.all_gather_copy_in(inputs, padded_numels, dtype)
        return AllGatherResult(comm.all_gather(flat_input, group), layout, None)
    # Eager: copy straight into this rank's slice of the output, as FSDP2 does, so an
    # in-flight all-gather holds one buffer, not two.
    input_numel = sum(
        n * (t.element_size() if dtype == torch.uint8 else 1)
        for n, t in zip(padded_numels, inputs)
    )
    with streams.copy_in_context() if streams is not None else contextlib.nullcontext():
        allocate = torch.empty if all_gather_comm is None else all_gather_comm.allocate
        output = allocate(
            (input_numel * layout.world_size,), dtype=dtype, device=inputs[0].device
        )
        flat_input = output.narrow(0, input_numel * layout.rank, input_numel)
        copy_backends.all_gather_copy_in_into(inputs, padded_numels, flat_input)
        pending = comm.all_gather_into(output, flat_input, group, all_gather_comm)
    return AllGatherResult(pending, layout, streams)


@torch.no_grad()
def foreach_all_gather_copy_out(result: AllGatherResult) -> list[torch.Tensor]:
    """Waits for the all-gather and unpacks it into unsharded tensors.

    Args:
        result: what :func:`foreach_all_gather` returned.

    Returns:
        One unsharded tensor per parameter, ``info.global_size`` and
        ``info.param_dtype`` each, freshly allocated.
    """
    output = comm.wait(result.pending)
    if result.streams is not None:
        result.streams.consume(output)
    return all_gather_output_copy_out(output, result.layout)


def all_gather_output_copy_out(output: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
    """Unpacks a completed all-gather output of ``layout``'s bucket (every rank's
    copy-in, in rank order) into unsharded tensors, as :func:`foreach_all_gather_copy_out`."""
    if copy_regions_in_use():
        return copy_out_in_region(output, layout)
    return copy_backends.all_gather_copy_out(
        output, layout.world_size, layout.global_sizes_flat, layout.global_ndims,
        layout.shard_dims, layout.param_dtypes,
    )
