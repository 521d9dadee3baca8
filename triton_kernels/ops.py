"""The fused copies as ``torch.library.triton_op``s (namespace ``fsdp_traceable_triton``).

Each op computes the same bits as its ``torch.ops.fsdp_traceable`` counterpart in one
kernel launch per bucket:

* ``all_gather_copy_in(shards, padded_numels, dtype)``: flat all-gather input.
* ``all_gather_copy_out(all_gather_output, world_size, global_sizes_flat, ndims,
  shard_dims, itemsizes)``: ONE flat buffer holding every unsharded parameter, each
  starting 16-byte aligned; :func:`unsharded_views` splits it into per-parameter
  views (the gaps between parameters are zero).
* ``reduce_scatter_copy_in(grads, world_size, shard_dims, reduce_dtype,
  predivide_factor)``: flat reduce-scatter input.

Run eagerly, the kernels read per-bucket metadata tables (built once, cached on the
device) and the copy-ins read their sources through a table of data pointers (cached
per set of addresses). While tracing, they launch kernels generated for the bucket
(:mod:`triton_kernels.codegen`) that take every source as an argument and carry the
metadata as literals, so Inductor sees every tensor the kernel reads. GPU tensors use
compiled kernels, CPU tensors the Triton interpreter; on CPU a ``triton_op`` cannot run
under ``torch.compile``, so traced CPU calls (and traced buckets of more than
``MAX_GENERATED_SOURCES`` parameters) decompose into the aten ops instead. Mixed-dtype
buckets (``uint8``) copy raw bytes.

The ops are total: what the kernels do not cover runs the aten op inside the
``triton_op`` (same bits): dtypes other than float32/bfloat16/float16, parameters
whose indices do not fit int32, and ``Shard(d > 0)`` dims that do not split evenly.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Optional

import torch
from torch.library import triton_op

from fsdp_traceable.sizes import aligned_offsets, copy_out_align, unflatten_sizes
from fsdp_traceable.tracing import is_tracing

from . import layout as layouts
from .fields import INT_OF_SIZE, KIND_BYTES, KINDS, SCALE_NONE
from .launch import launch_pack, launch_unpack, scale_for, traced_fallback

SUPPORTED_DTYPES = tuple(KINDS)

__all__ = [
    "all_gather_copy_in",
    "all_gather_copy_in_into",
    "all_gather_copy_out",
    "reduce_scatter_copy_in",
    "unsharded_views",
    "SUPPORTED_DTYPES",
]

@triton_op("fsdp_traceable_triton::all_gather_copy_in", mutates_args=())
def all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """Packs shards into the flat all-gather input (cast to ``dtype``, zero-padded to
    ``padded_numels``), like ``torch.ops.fsdp_traceable.all_gather_copy_in``.

    Args:
        shards: this rank's shards, on one device.
        padded_numels: each shard's padded numel in the flat input.
        dtype: the all-gather dtype; ``torch.uint8`` packs a mixed-dtype bucket as bytes.

    Returns:
        The flat all-gather input, ``sum(padded_numels)`` elements (bytes for uint8).
    """
    traced = is_tracing(shards)
    plan = None if traced and traced_fallback(shards) else _gather_plan(shards, padded_numels, dtype)
    if plan is None:
        return torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded_numels, dtype)
    flats, layout, dst_kind = plan
    out = torch.empty(layout.row_numel, dtype=dtype, device=shards[0].device)
    launch_pack(flats, out, layout, dst_kind, SCALE_NONE, 1.0, traced)
    return out


def all_gather_copy_in_into(
    shards: list[torch.Tensor], padded_numels: list[int], out: torch.Tensor
) -> None:
    """Eager-only: :func:`all_gather_copy_in` written into ``out`` (e.g. this rank's
    slice of the all-gather output), like ``fsdp_traceable.collectives.ops.all_gather_copy_in_into``.

    Args:
        shards: this rank's shards, on one device.
        padded_numels: each shard's padded numel in the flat input.
        out: a contiguous 1-D tensor of the all-gather dtype and the input's numel.
    """
    plan = _gather_plan(shards, padded_numels, out.dtype)
    if plan is None or not out.is_contiguous() or out.numel() != plan[1].row_numel:
        out.copy_(torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded_numels, out.dtype))
        return
    flats, layout, dst_kind = plan
    launch_pack(flats, out, layout, dst_kind, SCALE_NONE, 1.0, traced=False)


def _gather_plan(
    shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype
) -> tuple[list[torch.Tensor], layouts.ChunkLayout, int] | None:
    """Flat sources, layout and destination kind of a copy-in, or ``None`` if the
    kernels do not cover it."""
    if dtype == torch.uint8:
        units = [1 if s.dtype == torch.uint8 else s.element_size() for s in shards]
        flats = [s.reshape(-1).view(torch.uint8) for s in shards]
        kinds = (KIND_BYTES,) * len(shards)
        dst_kind = KIND_BYTES
    else:
        if dtype not in KINDS or any(s.dtype not in KINDS for s in shards):
            return None
        units = [1] * len(shards)
        flats = [s.reshape(-1) for s in shards]
        kinds = tuple(KINDS[s.dtype] for s in shards)
        dst_kind = KINDS[dtype]
    layout = layouts.gather_layout(
        _static(f.numel() for f in flats),
        _static(p * u for p, u in zip(padded_numels, units)),
        kinds,
        layouts.DEFAULT_BLOCK,
    )
    return (flats, layout, dst_kind) if layout.fits_int32 else None


@triton_op("fsdp_traceable_triton::reduce_scatter_copy_in", mutates_args=())
def reduce_scatter_copy_in(
    grads: list[torch.Tensor],
    world_size: int,
    shard_dims: list[int],
    reduce_dtype: torch.dtype,
    predivide_factor: Optional[float],
) -> torch.Tensor:
    """Lays gradients out as ``torch._chunk_cat(dim0_grads, 0, world_size)``, cast to
    ``reduce_dtype`` and pre-divided, like ``torch.ops.fsdp_traceable.reduce_scatter_copy_in``.

    Args:
        grads: unsharded gradients, on one device.
        world_size: number of ranks.
        shard_dims: each gradient's shard dim.
        reduce_dtype: the reduce-scatter dtype.
        predivide_factor: divide by this after the cast (``None``: no divide).

    Returns:
        The flat reduce-scatter input of ``reduce_dtype``.
    """
    traced = is_tracing(grads)
    world_size, shard_dims = _static(world_size), _static(shard_dims)
    layout = None
    if not (traced and traced_fallback(grads)):
        layout = _reduce_scatter_layout(grads, world_size, shard_dims, reduce_dtype)
    if layout is None:
        return torch.ops.fsdp_traceable.reduce_scatter_copy_in(
            grads, world_size, shard_dims, reduce_dtype, predivide_factor)
    out = torch.empty(world_size * layout.row_numel, dtype=reduce_dtype, device=grads[0].device)
    scale_mode, scale = scale_for(predivide_factor, out.device)
    sources = [g.contiguous() for g in grads]
    launch_pack(sources, out, layout, KINDS[reduce_dtype], scale_mode, scale, traced)
    return out


def _reduce_scatter_layout(
    grads: list[torch.Tensor], world_size: int, shard_dims: list[int], reduce_dtype: torch.dtype
) -> layouts.ChunkLayout | None:
    if reduce_dtype not in KINDS or any(g.dtype not in KINDS for g in grads):
        return None
    sizes = tuple(_static(g.shape) for g in grads)
    dims = _even_shard_dims(sizes, shard_dims, world_size)
    if dims is None:
        return None
    kinds = tuple(KINDS[g.dtype] for g in grads)
    layout = layouts.chunk_layout(sizes, dims, world_size, kinds, layouts.DEFAULT_BLOCK)
    return layout if layout.fits_int32 else None


def _static(values) -> tuple[int, ...] | int:
    """``values`` (an int or ints) as plain ints. A kernel's layout is built from
    concrete sizes (its metadata are literals or a cached table), so symbolic sizes
    under ``torch.compile`` with dynamic shapes are specialized here: one guard per
    size, and the compiled kernel serves that bucket shape."""
    if isinstance(values, (int, torch.SymInt)):
        return int(values)
    return tuple(int(v) for v in values)


def _even_shard_dims(
    sizes: Sequence[Sequence[int]], shard_dims: Sequence[int], world_size: int
) -> tuple[int, ...] | None:
    """Shard dims made non-negative, or ``None`` if a ``Shard(d > 0)`` dim does not
    split evenly (the aten ops' ``torch.chunk`` then differs from the padded layout)."""
    dims = []
    for size, dim in zip(sizes, shard_dims):
        if not size:
            return None
        dim %= len(size)
        if dim > 0 and size[dim] % world_size:
            return None
        dims.append(dim)
    return tuple(dims)


@triton_op("fsdp_traceable_triton::all_gather_copy_out", mutates_args=())
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
    byte_mode = all_gather_output.dtype == torch.uint8
    itemsize = all_gather_output.element_size()
    world_size, shard_dims = _static(world_size), _static(shard_dims)
    sizes = tuple(_static(s) for s in unflatten_sizes(global_sizes_flat, _static(ndims)))
    dims = _even_shard_dims(sizes, shard_dims, world_size)
    units = _static(itemsizes) if byte_mode else None
    layout = None
    if dims is not None and itemsize in INT_OF_SIZE:
        kinds = (KIND_BYTES,) * len(sizes)
        layout = layouts.chunk_layout(sizes, dims, world_size, kinds, layouts.DEFAULT_BLOCK,
                                      units=units, out_align=copy_out_align(itemsize, byte_mode))
    device = all_gather_output.device
    traced = is_tracing([all_gather_output])
    if layout is None or not layout.fits_int32 or (traced and device.type == "cpu"):
        return _copy_out_reference(all_gather_output, world_size, global_sizes_flat, ndims,
                                   shard_dims, itemsizes)
    if all_gather_output.numel() != world_size * layout.row_numel:
        raise ValueError(
            f"all_gather_output has {all_gather_output.numel()} elements but the bucket "
            f"needs world_size * {layout.row_numel}; pass the output of the bucket's all-gather"
        )
    out = torch.empty(layout.out_numel, dtype=all_gather_output.dtype, device=device)
    int_dtype = INT_OF_SIZE[itemsize]
    launch_unpack(all_gather_output.contiguous().view(int_dtype), out.view(int_dtype), layout, traced)
    return out


def _copy_out_reference(
    all_gather_output: torch.Tensor, world_size: int, global_sizes_flat: list[int],
    ndims: list[int], shard_dims: list[int], itemsizes: list[int],
) -> torch.Tensor:
    """:func:`all_gather_copy_out`'s buffer built from the aten op, for what the
    kernels do not cover."""
    byte_mode = all_gather_output.dtype == torch.uint8
    dtype = all_gather_output.dtype
    dtypes = [INT_OF_SIZE[i] if byte_mode else dtype for i in itemsizes]
    outputs = torch.ops.fsdp_traceable.all_gather_copy_out(
        all_gather_output, world_size, global_sizes_flat, ndims, shard_dims, dtypes)
    flats = [o.reshape(-1).view(dtype) if byte_mode else o.reshape(-1) for o in outputs]
    offsets, end = aligned_offsets(
        [f.numel() for f in flats], copy_out_align(all_gather_output.element_size(), byte_mode))
    pieces = []
    for i, flat in enumerate(flats):
        pieces.append(flat)
        gap = (offsets[i + 1] if i + 1 < len(flats) else end) - offsets[i] - flat.numel()
        if gap:
            pieces.append(flat.new_zeros(gap))
    return torch.cat(pieces) if pieces else all_gather_output.new_empty(0)


def unsharded_views(
    flat: torch.Tensor,
    global_sizes_flat: list[int],
    ndims: list[int],
    dtypes: list[torch.dtype],
) -> list[torch.Tensor]:
    """Splits :func:`all_gather_copy_out`'s buffer into one view per parameter, of its
    global size and (for a byte buffer) its dtype. Cheap: no layout is built.

    Args:
        flat: what :func:`all_gather_copy_out` returned.
        global_sizes_flat, ndims: as passed to it.
        dtypes: each parameter's dtype.

    Returns:
        One view of ``flat`` per parameter.
    """
    byte_mode = flat.dtype == torch.uint8
    sizes = unflatten_sizes(global_sizes_flat, ndims)
    numels = [math.prod(size) * (dtype.itemsize if byte_mode else 1)
              for size, dtype in zip(sizes, dtypes)]
    offsets, _ = aligned_offsets(numels, copy_out_align(flat.element_size(), byte_mode))
    views = []
    for size, dtype, offset, numel in zip(sizes, dtypes, offsets, numels):
        piece = flat.narrow(0, offset, numel)
        if byte_mode and dtype != torch.uint8:
            piece = piece.view(dtype)
        views.append(piece.view(size))
    return views
