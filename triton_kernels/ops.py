"""The fused copies as custom ops (namespace ``fsdp_traceable_triton``), one tile
kernel launch per bucket each:

* ``all_gather_copy_in(shards, padded_numels, dtype)``: flat all-gather input.
* ``all_gather_copy_out(all_gather_output, world_size, global_sizes_flat, ndims,
  shard_dims, itemsizes)``: ONE flat buffer holding every unsharded parameter, each
  starting 16-byte aligned; :func:`unsharded_views` splits it into per-parameter
  views (the gaps between parameters are zero).
* ``reduce_scatter_copy_in(grads, world_size, shard_dims, reduce_dtype,
  predivide_factor)``: flat reduce-scatter input.

Each computes the same bits as its ``torch.ops.fsdp_traceable`` counterpart. The
ops are opaque to ``torch.compile`` (``torch.library.custom_op`` with a fake impl):
Inductor emits one call per copy that launches the same kernel as eager. A kernel
reading many parameters cannot be a ``wrap_triton`` node in Inductor's graph: it
reads them through a table of their addresses, which Inductor cannot see, so it
would free or reuse a source's memory before the kernel read it. One kernel serves
every bucket (its metadata are tables), so nothing is generated or compiled per
bucket shape. GPU tensors run the compiled kernels, CPU tensors the Triton
interpreter. Mixed-dtype buckets (``uint8``) copy raw bytes.

The plain functions of the same names skip the dispatcher in eager (its cost is
about that of a launch) and call the op while tracing.

The ops are total: what the kernels do not cover runs the aten op (same bits):
dtypes other than float32/bfloat16/float16, buckets whose indices do not fit int32,
and ``Shard(d > 0)`` dims that do not split evenly.
"""

from __future__ import annotations

from typing import Optional

import torch

from fsdp_traceable.tracing import is_tracing

from . import plans
from .dtypes import INT_OF_SIZE, KINDS
from .fields import SCALE_NONE
from .launch import launch_pack, launch_unpack
from .launch_args import scale_for
from .plans import unsharded_views

SUPPORTED_DTYPES = tuple(KINDS)

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_in_into",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "unsharded_views",
    "SUPPORTED_DTYPES",
]


def _copy_in(shards: list[torch.Tensor], padded_numels: list[int],
             dtype: torch.dtype) -> torch.Tensor:
    plan = plans.gather_plan(shards, padded_numels, dtype)
    if plan is None:
        return torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded_numels, dtype)
    sources, layout, dst_kind = plan
    out = torch.empty(layout.row_numel, dtype=dtype, device=shards[0].device)
    launch_pack(sources, out, layout, dst_kind, SCALE_NONE, 1.0)
    return out


@torch.library.custom_op("fsdp_traceable_triton::all_gather_copy_in", mutates_args=())
def _copy_in_op(shards: list[torch.Tensor], padded_numels: list[int],
                dtype: torch.dtype) -> torch.Tensor:
    return _copy_in(shards, padded_numels, dtype)


@_copy_in_op.register_fake
def _(shards, padded_numels, dtype):
    units = plans.copy_units(shards, dtype)
    numel = sum(int(p) * u for p, u in zip(padded_numels, units))
    return shards[0].new_empty(numel, dtype=dtype)


def all_gather_copy_in(shards: list[torch.Tensor], padded_numels: list[int],
                       dtype: torch.dtype) -> torch.Tensor:
    """The copy contract's ``all_gather_copy_in`` (``fsdp_traceable.collectives.copy_contract``):
    one tile kernel, traced as one opaque op."""
    if is_tracing(shards[:1]):  # a traced call's tensors are all traced
        return _copy_in_op(shards, padded_numels, dtype)
    return _copy_in(shards, padded_numels, dtype)


def all_gather_copy_in_into(
    shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor
) -> None:
    """The copy contract's ``all_gather_copy_in_into`` (eager only): the tile kernel
    writes into ``out``; the aten copy-in when no plan fits."""
    plan = plans.gather_plan(shards, padded_numels, out.dtype)
    if plan is None or not out.is_contiguous() or out.numel() != plan[1].row_numel:
        out.copy_(torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded_numels, out.dtype))
        return
    sources, layout, dst_kind = plan
    launch_pack(sources, out, layout, dst_kind, SCALE_NONE, 1.0)


def _reduce_scatter_copy_in(grads: list[torch.Tensor], world_size: int, shard_dims: list[int],
                            reduce_dtype: torch.dtype,
                            predivide_factor: Optional[float]) -> torch.Tensor:
    layout = plans.reduce_scatter_layout(grads, world_size, shard_dims, reduce_dtype)
    if layout is None:
        return torch.ops.fsdp_traceable.reduce_scatter_copy_in(
            grads, world_size, shard_dims, reduce_dtype, predivide_factor)
    out = torch.empty(world_size * layout.row_numel, dtype=reduce_dtype, device=grads[0].device)
    scale_mode, scale = scale_for(predivide_factor, out.device.type)
    launch_pack(plans.contiguous(grads), out, layout, KINDS[reduce_dtype], scale_mode, scale)
    return out


@torch.library.custom_op("fsdp_traceable_triton::reduce_scatter_copy_in", mutates_args=())
def _reduce_scatter_copy_in_op(grads: list[torch.Tensor], world_size: int,
                               shard_dims: list[int], reduce_dtype: torch.dtype,
                               predivide_factor: Optional[float]) -> torch.Tensor:
    return _reduce_scatter_copy_in(grads, world_size, shard_dims, reduce_dtype, predivide_factor)


@_reduce_scatter_copy_in_op.register_fake
def _(grads, world_size, shard_dims, reduce_dtype, predivide_factor):
    world = int(world_size)
    numel = world * plans.chunk_row_numel([plans.static(g.shape) for g in grads],
                                          plans.static(shard_dims), world)
    return grads[0].new_empty(numel, dtype=reduce_dtype)


def reduce_scatter_copy_in(
    grads: list[torch.Tensor],
    world_size: int,
    shard_dims: list[int],
    reduce_dtype: torch.dtype,
    predivide_factor: Optional[float],
) -> torch.Tensor:
    """The copy contract's ``reduce_scatter_copy_in``: one tile kernel (cast and
    pre-divide fused), traced as one opaque op."""
    if is_tracing(grads[:1]):  # a traced call's tensors are all traced
        return _reduce_scatter_copy_in_op(grads, world_size, shard_dims, reduce_dtype,
                                          predivide_factor)
    return _reduce_scatter_copy_in(grads, world_size, shard_dims, reduce_dtype, predivide_factor)


def _copy_out(all_gather_output: torch.Tensor, world_size: int, global_sizes_flat: list[int],
              ndims: list[int], shard_dims: list[int], itemsizes: list[int]) -> torch.Tensor:
    layout = plans.copy_out_layout(all_gather_output, world_size, global_sizes_flat, ndims,
                                   shard_dims, itemsizes)
    if layout is None:
        return plans.copy_out_reference(all_gather_output, world_size, global_sizes_flat,
                                        ndims, shard_dims, itemsizes)
    if all_gather_output.numel() != world_size * layout.row_numel:
        raise ValueError(
            f"all_gather_output has {all_gather_output.numel()} elements but the bucket "
            f"needs world_size * {layout.row_numel}; pass the output of the bucket's all-gather"
        )
    out = torch.empty(layout.out_numel, dtype=all_gather_output.dtype,
                      device=all_gather_output.device)
    int_dtype = INT_OF_SIZE[all_gather_output.element_size()]
    launch_unpack(all_gather_output.contiguous().view(int_dtype), out.view(int_dtype), layout)
    return out


@torch.library.custom_op("fsdp_traceable_triton::all_gather_copy_out", mutates_args=())
def _copy_out_op(all_gather_output: torch.Tensor, world_size: int, global_sizes_flat: list[int],
                 ndims: list[int], shard_dims: list[int], itemsizes: list[int]) -> torch.Tensor:
    return _copy_out(all_gather_output, world_size, global_sizes_flat, ndims, shard_dims,
                     itemsizes)


@_copy_out_op.register_fake
def _(all_gather_output, world_size, global_sizes_flat, ndims, shard_dims, itemsizes):
    numel = plans.copy_out_numel(all_gather_output, global_sizes_flat, ndims, itemsizes)
    return all_gather_output.new_empty(numel)


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    global_sizes_flat: list[int],
    ndims: list[int],
    shard_dims: list[int],
    itemsizes: list[int],
) -> torch.Tensor:
    """Unpacks the ``[world_size * numel]`` all-gather output into ONE flat buffer of
    unsharded parameters (``Shard(0)`` padding stripped, ``Shard(d > 0)`` chunks
    concatenated along ``d``, each parameter 16-byte aligned, zeros between them);
    split it with :func:`unsharded_views`.

    Args:
        all_gather_output: the all-gather output; ``uint8`` for a mixed-dtype bucket.
        world_size: number of ranks.
        global_sizes_flat: the unsharded sizes, flattened (see ``flatten_sizes``).
        ndims: each parameter's number of dims.
        shard_dims: each parameter's shard dim.
        itemsizes: each parameter's ``dtype.itemsize`` (read only for a ``uint8``
            output; dtypes cannot travel in an inferred schema).

    Returns:
        The flat buffer, of ``all_gather_output``'s dtype.
    """
    if is_tracing([all_gather_output]):
        return _copy_out_op(all_gather_output, world_size, global_sizes_flat, ndims,
                            shard_dims, itemsizes)
    return _copy_out(all_gather_output, world_size, global_sizes_flat, ndims, shard_dims,
                     itemsizes)
