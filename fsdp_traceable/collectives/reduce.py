"""Bucketed gradient reduction: :func:`foreach_reduce`.

FSDP2's ``foreach_reduce``: one reduce-scatter copy-in, one reduce-scatter over the
shard group (and, for HSDP, one all-reduce over the replicate group) per bucket,
with FSDP2's divide factors (see :mod:`~fsdp_traceable.collectives.divide_factors`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

try:  # FSDP2's DTensor construction without from_local's autograd and argument checks
    from torch.distributed.fsdp._fully_shard._fsdp_common import _from_local_no_grad
except ImportError:
    _from_local_no_grad = None

from ..profiler_labels import phase
from ..tracing import compiled_autograd_regions_in_use
from ..whole_step.copy_regions import reduce_scatter_copy_in_in_region
from . import comm, copy_backends, ops
from .bucket_layout import BucketLayout
from .divide_factors import ReduceSchedule, gradient_divide_schedule
from .shard_info import ShardInfo
from .validation import (
    check_bucket,
    check_bucket_bytes,
    check_reduce_state,
    check_uniform,
    normalize_reduce_op,
)

if TYPE_CHECKING:  # FSDP2's comm interface, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

__all__ = [
    "PendingReduce",
    "ReduceResult",
    "accumulate_sharded_grad",
    "finish_foreach_reduce",
    "foreach_reduce",
    "start_foreach_reduce",
]


class ReduceResult(NamedTuple):
    """What :func:`foreach_reduce` produced.

    ``sharded_grads`` holds one contiguous sharded gradient per parameter (in its
    ``orig_dtype``, on CPU when offloaded), or ``None`` when the HSDP all-reduce was
    skipped; ``partial_reduce_output`` then carries the accumulated reduce-scatter
    output to pass to the next call.
    """

    sharded_grads: list[torch.Tensor] | None
    partial_reduce_output: torch.Tensor | None


class PendingReduce(NamedTuple):
    """A reduction whose reduce-scatter is in flight; pass it to :func:`finish_foreach_reduce`."""

    reduce_output: comm.PendingTensor
    layout: BucketLayout
    schedule: ReduceSchedule
    orig_dtype: torch.dtype
    all_reduce_group: dist.ProcessGroup | None
    all_reduce_grads: bool
    partial_reduce_output: torch.Tensor | None
    all_reduce_hook: Callable[[torch.Tensor], None] | None
    accumulate_into: Sequence[torch.Tensor] | None


@torch.no_grad()
def foreach_reduce(*args: Any, **kwargs: Any) -> ReduceResult:
    """Reduce-scatters a bucket of unsharded gradients into sharded gradients.

    :func:`start_foreach_reduce` then :func:`finish_foreach_reduce`; the arguments are
    the former's.

    Returns:
        The :class:`ReduceResult`.
    """
    return finish_foreach_reduce(start_foreach_reduce(*args, **kwargs))


@torch.no_grad()
def start_foreach_reduce(
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
    reduce_scatter_comm: ReduceScatter | None = None,
    check: bool = True,
    layout: BucketLayout | None = None,
) -> PendingReduce:
    """Copies a bucket of unsharded gradients in and starts its reduce-scatter.

    One reduce-scatter over ``reduce_scatter_group`` (and, for HSDP, one all-reduce
    over ``all_reduce_group``) for the whole bucket, with FSDP2's averaging
    numerics (see :func:`~fsdp_traceable.collectives.divide_factors.gradient_divide_schedule`).

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
        reduce_scatter_comm: eager-only FSDP2 ``ReduceScatter``: allocates the
            reduce-scatter's input (the copy-in is copied into it) and output, and
            runs the collective.
        check: validate the bucket and the state arguments (``False``: the caller
            built them together and checked them once, as ``fully_shard``'s groups do).
        layout: ``BucketLayout.of(infos)``, where the caller keeps it (see
            [Note: bucket layouts]).

    Returns:
        The :class:`PendingReduce` (in eager mode an async c10d reduce-scatter, so
        compute can run before :func:`finish_foreach_reduce`).
    """
    if check:
        check_bucket(unsharded_grads, infos, reduce_scatter_group,
                     tensors_name="unsharded_grads", expect="unsharded")
        check_bucket_bytes(infos)
    check_uniform([g.dtype for g in unsharded_grads], "unsharded_grads dtype",
                  "cast every gradient of a bucket to one dtype (the param_dtype)")
    if layout is None:
        layout = BucketLayout.of(infos)
    reduce_dtype = layout.reduce_dtype or check_uniform(
        [i.reduce_dtype for i in infos], "reduce_dtype",
        "build every ShardInfo of a bucket with one reduce_dtype")
    orig_dtype = layout.orig_dtype or check_uniform(
        [i.orig_dtype for i in infos], "orig_dtype", "bucket parameters of one dtype together")
    if check:
        check_reduce_state(
            infos, reduce_dtype, has_all_reduce_group=all_reduce_group is not None,
            all_reduce_grads=all_reduce_grads, partial_reduce_output=partial_reduce_output,
            accumulate_into=accumulate_into,
        )
    all_reduce_size = 1
    if all_reduce_group is not None:
        all_reduce_size = all_reduce_group.size()
    world_size = layout.world_size
    schedule = gradient_divide_schedule(
        world_size, all_reduce_size, reduce_dtype, gradient_divide_factor, force_sum_reduction
    )
    if reduce_op is not None:
        op = normalize_reduce_op(reduce_op, reduce_scatter_group)
        schedule = schedule._replace(predivide_factor=None, postdivide_factor=None,
                                     reduce_scatter_op=op, all_reduce_op=op)

    if compiled_autograd_regions_in_use():
        reduce_input = reduce_scatter_copy_in_in_region(
            list(unsharded_grads), layout, reduce_dtype, _nontrivial(schedule.predivide_factor))
    else:
        reduce_input = copy_backends.reduce_scatter_copy_in(
            list(unsharded_grads), world_size, layout.shard_dims, reduce_dtype,
            _nontrivial(schedule.predivide_factor),
        )
    if world_size > 1:
        reduce_output = comm.start_reduce_scatter(reduce_input, schedule.reduce_scatter_op,
                                                  reduce_scatter_group, reduce_scatter_comm)
    else:
        reduce_output = comm.PendingTensor(reduce_input, None)
    return PendingReduce(
        reduce_output, layout, schedule, orig_dtype, all_reduce_group, all_reduce_grads,
        partial_reduce_output, all_reduce_hook, accumulate_into,
    )


@torch.no_grad()
def finish_foreach_reduce(pending: PendingReduce) -> ReduceResult:
    """Waits for the reduce-scatter, runs the HSDP all-reduce and the hook, and
    unpacks the sharded gradients (accumulating them where asked).

    Args:
        pending: what :func:`start_foreach_reduce` returned.

    Returns:
        The :class:`ReduceResult`.
    """
    with phase("reduce_scatter_wait"):
        reduce_output = comm.wait(pending.reduce_output)
    layout, schedule = pending.layout, pending.schedule
    all_reduce_group, partial_reduce_output = pending.all_reduce_group, pending.partial_reduce_output
    if all_reduce_group is not None:
        if not pending.all_reduce_grads:
            if partial_reduce_output is not None:
                reduce_output = partial_reduce_output + reduce_output
            return ReduceResult(None, reduce_output)
        with phase("all_reduce"):
            if partial_reduce_output is not None:
                reduce_output = reduce_output + partial_reduce_output
            if all_reduce_group.size() > 1:
                reduce_output = comm.all_reduce(reduce_output, schedule.all_reduce_op,
                                                all_reduce_group)
    if pending.all_reduce_hook is not None:
        pending.all_reduce_hook(reduce_output)

    sharded_grads = ops.call(
        "reduce_scatter_view_out", reduce_output, list(layout.sharded_sizes_flat),
        list(layout.sharded_ndims), list(layout.padded_sharded_numels), pending.orig_dtype,
        _nontrivial(schedule.postdivide_factor),
    )
    if any(layout.offload_to_cpu):
        sharded_grads = [grad.to("cpu") if offloaded else grad
                         for grad, offloaded in zip(sharded_grads, layout.offload_to_cpu)]
    if pending.accumulate_into is not None:
        for param, grad in zip(pending.accumulate_into, sharded_grads):
            accumulate_sharded_grad(param, grad)
    return ReduceResult(sharded_grads, None)


def accumulate_sharded_grad(param: torch.Tensor, sharded_grad: torch.Tensor) -> None:
    """Adds ``sharded_grad`` into ``param.grad`` (a DTensor if ``param`` is one) and runs
    ``param``'s post-accumulate-grad hooks, as FSDP2's reduce does."""
    if param.grad is None:
        if isinstance(param, DTensor):
            param.grad = _sharded_like(param, sharded_grad)
        else:
            param.grad = sharded_grad
    else:
        grad = param.grad
        local = grad._local_tensor if isinstance(grad, DTensor) else grad
        local += sharded_grad
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        hook(param)


def _sharded_like(param: DTensor, local: torch.Tensor) -> DTensor:
    """``local`` as a DTensor laid out as ``param``; reuses the parameter's spec (FSDP2's
    cheap construction) when the layouts agree, as they do for every reduced gradient."""
    if (
        local.dtype == param.dtype
        and local.shape == param._local_tensor.shape
        and local.is_contiguous()
    ):
        if not torch.compiler.is_compiling():
            # The constructor itself: FSDP2's wrapper of it only adds a Dynamo-disable
            # frame, a few microseconds per parameter per step.
            return DTensor(local, param._spec, requires_grad=False)
        if _from_local_no_grad is not None:
            return _from_local_no_grad(local, param._spec)
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                              stride=param.stride(), run_check=False)


def _nontrivial(factor: float | None) -> float | None:
    return None if factor is None or factor == 1 else factor
