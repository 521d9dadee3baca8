"""Bucketed FSDP collectives: foreach all-gather, copy-out and reduce.

The same three entry points as FSDP2's ``_fsdp_collectives`` module, on plain
tensors plus :class:`~fsdp_traceable.shard_info.ShardInfo` metadata instead of
``FSDPParam``. Each runs as functional collectives while tracing and as async c10d
in eager (see :mod:`fsdp_traceable.comm`); all copies go through the
``torch.ops.fsdp_traceable`` ops (or the kernels ``config.copy_kernels`` picks, which
compute the same bits), so both paths compute the same bits.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from . import comm, copy_dispatch
from .divide_factors import gradient_divide_schedule
from .ops import flatten_sizes
from .shard_info import ShardInfo
from .validation import (
    check_bucket,
    check_bucket_bytes,
    check_reduce_state,
    check_uniform,
    normalize_reduce_op,
)

__all__ = [
    "AllGatherResult",
    "ReduceResult",
    "foreach_all_gather",
    "foreach_all_gather_copy_out",
    "foreach_reduce",
]


class AllGatherResult(NamedTuple):
    """An all-gather in flight; pass it to :func:`foreach_all_gather_copy_out`."""

    pending: comm.PendingTensor
    infos: tuple[ShardInfo, ...]
    streams: comm.DeviceStreams | None


class ReduceResult(NamedTuple):
    """What :func:`foreach_reduce` produced.

    ``sharded_grads`` holds one contiguous sharded gradient per parameter (in its
    ``orig_dtype``, on CPU when offloaded), or ``None`` when the HSDP all-reduce was
    skipped; ``partial_reduce_output`` then carries the accumulated reduce-scatter
    output to pass to the next call.
    """

    sharded_grads: list[torch.Tensor] | None
    partial_reduce_output: torch.Tensor | None


def all_gather_dtype(infos: Sequence[ShardInfo]) -> torch.dtype:
    """The bucket's all-gather dtype: the common ``param_dtype``, or ``uint8`` if mixed."""
    dtypes = {info.param_dtype for info in infos}
    return dtypes.pop() if len(dtypes) == 1 else torch.uint8


@torch.no_grad()
def foreach_all_gather(
    sharded_tensors: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    group: dist.ProcessGroup,
    *,
    streams: comm.DeviceStreams | None = None,
) -> AllGatherResult:
    """Copies this rank's shards into one buffer and starts one all-gather of it.

    Args:
        sharded_tensors: this rank's shards, ``info.sharded_size`` each (unpadded;
            the copy-in pads and casts to ``info.param_dtype``).
        infos: one :class:`ShardInfo` per shard.
        group: the shard process group.
        streams: eager-only copy-in stream holder for devices with streams.

    Returns:
        The in-flight :class:`AllGatherResult`; compute may run before copy-out.
    """
    check_bucket(sharded_tensors, infos, group, tensors_name="sharded_tensors", expect="sharded")
    check_bucket_bytes(infos)
    dtype = all_gather_dtype(infos)
    padded_numels = [info.padded_sharded_numel for info in infos]
    traced = comm.use_traced_path()
    inputs = list(sharded_tensors)
    if dtype == torch.uint8:
        # The byte path reinterprets each shard as it is: cast to its param_dtype first.
        inputs = [t.to(i.param_dtype) for t, i in zip(inputs, infos)]
    if traced:
        flat_input = copy_dispatch.all_gather_copy_in(inputs, padded_numels, dtype)
        return AllGatherResult(comm.all_gather(flat_input, group), tuple(infos), None)
    # Eager: copy straight into this rank's slice of the output, as FSDP2 does, so an
    # in-flight all-gather holds one buffer, not two.
    input_numel = sum(
        n * (t.element_size() if dtype == torch.uint8 else 1)
        for n, t in zip(padded_numels, inputs)
    )
    with streams.copy_in_context() if streams is not None else contextlib.nullcontext():
        output = torch.empty(
            input_numel * infos[0].world_size, dtype=dtype, device=inputs[0].device
        )
        flat_input = output.narrow(0, input_numel * infos[0].rank, input_numel)
        copy_dispatch.all_gather_copy_in_into(inputs, padded_numels, flat_input)
        pending = comm.all_gather_into(output, flat_input, group)
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
    return copy_dispatch.all_gather_copy_out(
        output,
        infos[0].world_size,
        sizes_flat,
        ndims,
        [info.shard_dim for info in infos],
        [info.param_dtype for info in infos],
    )


@torch.no_grad()
def foreach_reduce(
    unsharded_grads: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    reduce_scatter_group: dist.ProcessGroup,
    *,
    all_reduce_group: dist.ProcessGroup | None = None,
    gradient_divide_factor: float | None = None,
    reduce_op: str | dist.ReduceOp.RedOpType | None = None,
    force_sum_reduction: bool = False,
    all_reduce_grads: bool = True,
    partial_reduce_output: torch.Tensor | None = None,
    all_reduce_hook: Callable[[torch.Tensor], None] | None = None,
    accumulate_into: Sequence[torch.Tensor] | None = None,
) -> ReduceResult:
    """Reduce-scatters a bucket of unsharded gradients into sharded gradients.

    One reduce-scatter over ``reduce_scatter_group`` (and, for HSDP, one all-reduce
    over ``all_reduce_group``) for the whole bucket, with FSDP2's averaging
    numerics (see :func:`~fsdp_traceable.divide_factors.gradient_divide_schedule`).

    Args:
        unsharded_grads: one gradient per parameter, ``info.global_size``, one dtype.
        infos: one :class:`ShardInfo` per gradient (uniform reduce/orig dtype).
        reduce_scatter_group: the shard group.
        all_reduce_group: the replicate group for HSDP, else ``None``.
        gradient_divide_factor: divide the summed gradient by this instead of the
            data-parallel size.
        reduce_op: ``"sum"``/``"avg"`` to override the ops (no pre/post divide).
        force_sum_reduction: sum and divide explicitly instead of ``avg``.
        all_reduce_grads: with HSDP, ``False`` skips the all-reduce and accumulates
            the reduce-scatter output into ``partial_reduce_output`` instead.
        partial_reduce_output: the accumulation from earlier skipped all-reduces.
        all_reduce_hook: called on the reduced flat output (after the HSDP
            all-reduce, or after the reduce-scatter without HSDP); may mutate it.
        accumulate_into: sharded parameters whose ``.grad`` receives the result
            (assigned or added in place, as FSDP2 does), running their
            post-accumulate-grad hooks.

    Returns:
        The :class:`ReduceResult`.
    """
    check_bucket(unsharded_grads, infos, reduce_scatter_group, tensors_name="unsharded_grads",
                 expect="unsharded")
    check_bucket_bytes(infos)
    check_uniform([g.dtype for g in unsharded_grads], "unsharded_grads dtype",
                  "cast every gradient of a bucket to one dtype (the param_dtype)")
    reduce_dtype = check_uniform([i.reduce_dtype for i in infos], "reduce_dtype",
                                 "build every ShardInfo of a bucket with one reduce_dtype")
    orig_dtype = check_uniform([i.orig_dtype for i in infos], "orig_dtype",
                               "bucket parameters of one dtype together")
    check_reduce_state(
        infos, reduce_dtype, has_all_reduce_group=all_reduce_group is not None,
        all_reduce_grads=all_reduce_grads, partial_reduce_output=partial_reduce_output,
        accumulate_into=accumulate_into,
    )
    all_reduce_size = 1
    if all_reduce_group is not None:
        all_reduce_size = all_reduce_group.size()
    world_size = infos[0].world_size
    schedule = gradient_divide_schedule(
        world_size, all_reduce_size, reduce_dtype, gradient_divide_factor, force_sum_reduction
    )
    if reduce_op is not None:
        op = normalize_reduce_op(reduce_op, reduce_scatter_group)
        schedule = schedule._replace(predivide_factor=None, postdivide_factor=None,
                                     reduce_scatter_op=op, all_reduce_op=op)

    reduce_input = copy_dispatch.reduce_scatter_copy_in(
        list(unsharded_grads), world_size, [i.shard_dim for i in infos], reduce_dtype,
        _nontrivial(schedule.predivide_factor),
    )
    if world_size > 1:
        reduce_output = comm.reduce_scatter(reduce_input, schedule.reduce_scatter_op,
                                            reduce_scatter_group)
    else:
        reduce_output = reduce_input

    if all_reduce_group is not None:
        if not all_reduce_grads:
            if partial_reduce_output is not None:
                reduce_output = partial_reduce_output + reduce_output
            return ReduceResult(None, reduce_output)
        if partial_reduce_output is not None:
            reduce_output = reduce_output + partial_reduce_output
        if all_reduce_size > 1:
            reduce_output = comm.all_reduce(reduce_output, schedule.all_reduce_op,
                                            all_reduce_group)
    if all_reduce_hook is not None:
        all_reduce_hook(reduce_output)

    sizes_flat, ndims = flatten_sizes([info.sharded_size for info in infos])
    sharded_grads = torch.ops.fsdp_traceable.reduce_scatter_view_out(
        reduce_output, sizes_flat, ndims, [i.padded_sharded_numel for i in infos],
        orig_dtype, _nontrivial(schedule.postdivide_factor),
    )
    sharded_grads = [
        grad.to("cpu") if info.offload_to_cpu else grad for grad, info in zip(sharded_grads, infos)
    ]
    if accumulate_into is not None:
        for param, grad in zip(accumulate_into, sharded_grads):
            accumulate_sharded_grad(param, grad)
    return ReduceResult(sharded_grads, None)


def accumulate_sharded_grad(param: torch.Tensor, sharded_grad: torch.Tensor) -> None:
    """Adds ``sharded_grad`` into ``param.grad`` (a DTensor if ``param`` is one) and runs
    ``param``'s post-accumulate-grad hooks, as FSDP2's reduce does."""
    if param.grad is None:
        if isinstance(param, DTensor):
            param.grad = DTensor.from_local(
                sharded_grad, param.device_mesh, param.placements,
                shape=param.shape, stride=param.stride(), run_check=False,
            )
        else:
            param.grad = sharded_grad
    else:
        grad = param.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        local += sharded_grad
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _nontrivial(factor: float | None) -> float | None:
    return None if factor is None or factor == 1 else factor
