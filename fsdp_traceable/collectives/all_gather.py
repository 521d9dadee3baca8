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

from ..sizes import flatten_sizes
from . import comm, copy_backends
from .shard_info import SUPPORTED_DTYPES, ShardInfo
from .validation import check_bucket, check_bucket_bytes

if TYPE_CHECKING:  # FSDP2's comm interface, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

__all__ = ["AllGatherResult", "foreach_all_gather", "foreach_all_gather_copy_out"]


class AllGatherResult(NamedTuple):
    """An all-gather in flight; pass it to :func:`foreach_all_gather_copy_out`."""

    pending: comm.PendingTensor
    infos: tuple[ShardInfo, ...]
    streams: comm.DeviceStreams | None


def all_gather_dtype(infos: Sequence[ShardInfo]) -> torch.dtype:
    """The bucket's all-gather dtype: the common ``param_dtype``, or ``uint8`` if mixed
    or if it is one no backend reduces or gathers natively (e.g. float8)."""
    dtypes = {info.param_dtype for info in infos}
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in SUPPORTED_DTYPES:
        return dtype
    return torch.uint8


@torch.no_grad()
def foreach_all_gather(
    sharded_tensors: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    group: dist.ProcessGroup,
    *,
    streams: comm.DeviceStreams | None = None,
    all_gather_comm: AllGather | None = None,
    check: bool = True,
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

    Returns:
        The in-flight :class:`AllGatherResult`; compute may run before copy-out.
    """
    if check:
        check_bucket(sharded_tensors, infos, group, tensors_name="sharded_tensors",
                     expect="sharded")
        check_bucket_bytes(infos)
    dtype = all_gather_dtype(infos)
    padded_numels = [info.padded_sharded_numel for info in infos]
    traced = comm.use_traced_path()
    inputs = list(sharded_tensors)
    if dtype == torch.uint8:
        # The byte path reinterprets each shard as it is: cast to its param_dtype first.
        inputs = [t.to(i.param_dtype) for t, i in zip(inputs, infos)]
    if traced:
        if all_gather_comm is not None:
            raise NotImplementedError(
                "a custom all-gather (set_custom_all_gather) runs eagerly only: a compiled "
                "graph all-gathers with functional collectives; unset it before compiling "
                "(set_symm_mem_for_comm and set_allocate_memory_from_process_group_for_comm "
                "set one too)"
            )
        flat_input = copy_backends.all_gather_copy_in(inputs, padded_numels, dtype)
        return AllGatherResult(comm.all_gather(flat_input, group), tuple(infos), None)
    # Eager: copy straight into this rank's slice of the output, as FSDP2 does, so an
    # in-flight all-gather holds one buffer, not two.
    input_numel = sum(
        n * (t.element_size() if dtype == torch.uint8 else 1)
        for n, t in zip(padded_numels, inputs)
    )
    with streams.copy_in_context() if streams is not None else contextlib.nullcontext():
        allocate = torch.empty if all_gather_comm is None else all_gather_comm.allocate
        output = allocate(
            (input_numel * infos[0].world_size,), dtype=dtype, device=inputs[0].device
        )
        flat_input = output.narrow(0, input_numel * infos[0].rank, input_numel)
        copy_backends.all_gather_copy_in_into(inputs, padded_numels, flat_input)
        pending = comm.all_gather_into(output, flat_input, group, all_gather_comm)
    return AllGatherResult(pending, tuple(infos), streams)


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
    infos = result.infos
    sizes_flat, ndims = flatten_sizes([info.global_size for info in infos])
    return copy_backends.all_gather_copy_out(
        output,
        infos[0].world_size,
        sizes_flat,
        ndims,
        [info.shard_dim for info in infos],
        [info.param_dtype for info in infos],
    )
