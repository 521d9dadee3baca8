"""What a copy's arguments mean for the kernels: its cached layout, its sources, or
``None`` where the kernels do not cover it (the op then runs the aten op); and the
output sizes the ops' fake impls report.

Per call this only reads sizes, dtypes and shard dims into tuples for the
``lru_cache``'d layouts: no metadata is built for a bucket seen before.
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence

import torch

from fsdp_traceable.sizes import (
    aligned_offsets,
    ceil_div,
    copy_out_align,
    unflatten_sizes,
)

from . import layout as layouts
from .dtypes import INT_OF_SIZE, KINDS
from .fields import KIND_BYTES

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")


def static(values) -> tuple[int, ...] | int:
    """``values`` (an int or ints) as plain ints. A layout is built from concrete
    sizes (its metadata are a cached table), so symbolic sizes under
    ``torch.compile`` with dynamic shapes are specialized here: one guard per size."""
    if isinstance(values, (int, torch.SymInt)):
        return int(values)
    return tuple(map(int, values))


def copy_units(shards: Sequence[torch.Tensor], dtype: torch.dtype) -> list[int]:
    """Elements of ``dtype`` per element of each shard (bytes in a mixed bucket)."""
    if dtype != torch.uint8:
        return [1] * len(shards)
    return [1 if s.dtype == torch.uint8 else s.element_size() for s in shards]


def gather_plan(
    shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype
) -> tuple[list[torch.Tensor], layouts.ChunkLayout, int] | None:
    """Sources, layout and destination kind of an all-gather copy-in, or ``None``.

    Args:
        shards: this rank's shards, on one device.
        padded_numels: each shard's padded numel in the flat input.
        dtype: the all-gather dtype (``uint8``: raw bytes).

    Returns:
        ``(contiguous sources, layout, destination kind)`` or ``None``.
    """
    if dtype == torch.uint8:
        units = copy_units(shards, dtype)
        kinds = (KIND_BYTES,) * len(shards)
        dst_kind = KIND_BYTES
    else:
        units = None
        kinds = tuple(map(KINDS.get, map(_DTYPE, shards)))
        dst_kind = KINDS.get(dtype)
        if dst_kind is None or None in kinds:
            return None
    numels = tuple(map(torch.Tensor.numel, shards))
    padded = static(padded_numels)
    if units is not None:
        numels = tuple([n * u for n, u in zip(numels, units)])
        padded = tuple([p * u for p, u in zip(padded, units)])
    layout = layouts.gather_layout(numels, padded, kinds, layouts.DEFAULT_TILE)
    if not layout.fits_int32:
        return None
    return contiguous(shards), layout, dst_kind


def contiguous(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors``, made contiguous where they are not (the kernels index them flat)."""
    if all(map(torch.Tensor.is_contiguous, tensors)):
        return tensors
    return [t.contiguous() for t in tensors]


def even_shard_dims(
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


def reduce_scatter_layout(
    grads: list[torch.Tensor], world_size: int, shard_dims: list[int], reduce_dtype: torch.dtype
) -> layouts.ChunkLayout | None:
    """The reduce-scatter copy-in's layout, or ``None`` where the kernels do not cover it."""
    kinds = tuple(map(KINDS.get, map(_DTYPE, grads)))
    if reduce_dtype not in KINDS or None in kinds:
        return None
    sizes = tuple(map(_SHAPE, grads))  # torch.Size: a tuple, hashed as one
    return _even_chunk_layout(sizes, static(shard_dims), int(world_size), kinds, None, 1,
                              layouts.DEFAULT_TILE)


@functools.lru_cache(maxsize=1024)
def _even_chunk_layout(sizes, shard_dims, world_size, kinds, units, out_align, tile):
    """:func:`layouts.chunk_layout` where the kernels cover it, else ``None``; cached
    with the check, which costs as much as a launch for a large bucket."""
    dims = even_shard_dims(sizes, shard_dims, world_size)
    if dims is None:
        return None
    layout = layouts.chunk_layout(sizes, dims, world_size, kinds, tile, units=units,
                                  out_align=out_align)
    return layout if layout.fits_int32 else None


def chunk_row_numel(sizes: Sequence[Sequence[int]], shard_dims: Sequence[int],
                    world_size: int) -> int:
    """Elements per rank of ``torch._chunk_cat`` of tensors of ``sizes`` (dim-0 padded)."""
    total = 0
    for size, dim in zip(sizes, shard_dims):
        size = list(size) or [1]
        dim %= len(size)
        total += (math.prod(size[:dim]) * ceil_div(size[dim], world_size)
                  * math.prod(size[dim + 1 :]))
    return total


def copy_out_layout(all_gather_output: torch.Tensor, world_size: int,
                    global_sizes_flat: list[int], ndims: list[int], shard_dims: list[int],
                    itemsizes: list[int]) -> layouts.ChunkLayout | None:
    """The copy-out's layout, or ``None`` where the kernels do not cover it."""
    byte_mode = all_gather_output.dtype == torch.uint8
    itemsize = all_gather_output.element_size()
    if itemsize not in INT_OF_SIZE:
        return None
    return _copy_out_layout(static(global_sizes_flat), static(ndims), static(shard_dims),
                            int(world_size), static(itemsizes) if byte_mode else None,
                            copy_out_align(itemsize, byte_mode), layouts.DEFAULT_TILE)


@functools.lru_cache(maxsize=1024)
def _copy_out_layout(sizes_flat, ndims, shard_dims, world_size, units, out_align, tile):
    sizes = tuple(map(tuple, unflatten_sizes(sizes_flat, ndims)))
    return _even_chunk_layout(sizes, shard_dims, world_size, (KIND_BYTES,) * len(sizes), units,
                              out_align, tile)


def _unit_numels(global_sizes_flat, ndims, units) -> list[int]:
    sizes = unflatten_sizes(static(global_sizes_flat), static(ndims))
    return [math.prod(size) * unit for size, unit in zip(sizes, units)]


def copy_out_numel(all_gather_output: torch.Tensor, global_sizes_flat: list[int],
                   ndims: list[int], itemsizes: list[int]) -> int:
    """Elements of the copy-out's flat buffer (alignment gaps included)."""
    byte_mode = all_gather_output.dtype == torch.uint8
    units = static(itemsizes) if byte_mode else [1] * len(ndims)
    numels = _unit_numels(global_sizes_flat, ndims, units)
    return aligned_offsets(numels, copy_out_align(all_gather_output.element_size(), byte_mode))[1]


def copy_out_reference(
    all_gather_output: torch.Tensor, world_size: int, global_sizes_flat: list[int],
    ndims: list[int], shard_dims: list[int], itemsizes: list[int],
) -> torch.Tensor:
    """The copy-out's flat buffer built from the aten op, for what the kernels do not
    cover."""
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
    """Splits the copy-out's flat buffer into one view per parameter, of its global
    size and (for a byte buffer) its dtype. Cheap: no layout is built.

    Args:
        flat: what ``all_gather_copy_out`` returned.
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
