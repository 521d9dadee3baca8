"""Eager copy-in / copy-out into preallocated buffers with foreach kernels, as FSDP2 does.

An implementation of :class:`~.copy_contract.CopyOps`, bitwise equal to the
``torch.ops.fsdp_traceable`` ops: one output buffer per call,
filled by ``torch._foreach_copy_``, ``torch.split_with_sizes_copy`` and
``torch._chunk_cat(..., out=)`` (a few multi-tensor kernels instead of one per
parameter). Eager only: they write into ``out=`` buffers, which is what the
functional ops avoid while tracing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ..sizes import aligned_offsets, ceil_div, copy_out_align
from .ops import copy_out_layout, nonempty_chunks_to_dim0


def all_gather_copy_in(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """:meth:`CopyOps.all_gather_copy_in`: ``_foreach_copy_`` into one buffer."""
    flats, sizes = _flat_inputs(shards, padded_numels, dtype)
    out = torch.empty(sum(sizes), dtype=dtype, device=shards[0].device)
    _copy_in(flats, sizes, out)
    return out


def all_gather_copy_in_into(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor
) -> None:
    """:meth:`CopyOps.all_gather_copy_in_into`: ``_foreach_copy_`` into ``out``."""
    flats, sizes = _flat_inputs(shards, padded_numels, out.dtype)
    if out.dim() != 1 or out.numel() != sum(sizes):
        raise ValueError(
            f"out has shape {tuple(out.shape)} but the bucket's all-gather input has "
            f"{sum(sizes)} elements: pass a 1-D slice of that size"
        )
    _copy_in(flats, sizes, out)


def _flat_inputs(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
) -> tuple[list[torch.Tensor], list[int]]:
    flats, sizes = [], []
    for shard, padded in zip(shards, padded_numels):
        flat = shard.reshape(-1)
        if dtype == torch.uint8 and shard.dtype != torch.uint8:
            flat, padded = flat.view(torch.uint8), padded * shard.element_size()
        flats.append(flat)
        sizes.append(int(padded))
    return flats, sizes


def _copy_in(flats: list[torch.Tensor], sizes: list[int], out: torch.Tensor) -> None:
    dsts, srcs, pads = [], [], []
    for flat, piece in zip(flats, out.split(sizes)):
        n = min(flat.numel(), piece.numel())
        if n:
            dsts.append(piece[:n])
            srcs.append(flat[:n])
        if piece.numel() > n:
            pads.append(piece[n:])
    if dsts:
        torch._foreach_copy_(dsts, srcs)
    if pads:
        torch._foreach_zero_(pads)


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    global_sizes_flat: Sequence[int],
    ndims: Sequence[int],
    shard_dims: Sequence[int],
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """:meth:`CopyOps.all_gather_copy_out`: one ``split_with_sizes_copy``; the
    ``Shard(0)`` outputs are views into one buffer (padded per parameter, as FSDP2's),
    the ``Shard(d > 0)`` ones fresh tensors."""
    as_bytes = all_gather_output.dtype == torch.uint8
    global_sizes, padded_sizes, split_sizes = copy_out_layout(
        world_size, global_sizes_flat, ndims, shard_dims, dtypes, as_bytes
    )
    align = copy_out_align(all_gather_output.element_size(), as_bytes)
    offsets, total = aligned_offsets([world_size * split for split in split_sizes], align)
    buffer = all_gather_output.new_empty(total)
    gathered = [
        buffer.narrow(0, offset, world_size * split).view(world_size, split)
        for offset, split in zip(offsets, split_sizes)
    ]
    torch.split_with_sizes_copy(
        all_gather_output.view(world_size, -1), split_sizes, dim=1, out=gathered
    )
    outputs = []
    for chunk, global_size, padded_size, shard_dim, dtype in zip(
        gathered, global_sizes, padded_sizes, shard_dims, dtypes
    ):
        flat = chunk.view(-1)
        if as_bytes and dtype != torch.uint8:
            flat = flat.view(dtype)
        if shard_dim == 0:
            outputs.append(flat[: math.prod(global_size)].view(global_size))
        else:
            stacked = flat.view([world_size] + padded_size)
            outputs.append(stacked.movedim(0, shard_dim).contiguous().view(global_size))
    return outputs


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    world_size: int,
    shard_dims: Sequence[int],
    reduce_dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    """:meth:`CopyOps.reduce_scatter_copy_in`: one ``torch._chunk_cat`` into a
    ``reduce_dtype`` buffer (casting on the way), then an in-place pre-divide."""
    dim0_grads = nonempty_chunks_to_dim0(grads, world_size, shard_dims)
    if not dim0_grads:
        return grads[0].new_zeros(0, dtype=reduce_dtype)
    row_numel = sum(
        ceil_div(grad.size(0), world_size) * math.prod(grad.shape[1:]) for grad in dim0_grads
    )
    out = torch.empty(world_size, row_numel, dtype=reduce_dtype, device=dim0_grads[0].device)
    torch._chunk_cat(dim0_grads, 0, world_size, out=out)
    if predivide_factor is not None:
        out.div_(predivide_factor)
    return out.view(-1)
