"""Static per-bucket metadata for the copy kernels, computed once per bucket shape.

A bucket's layout depends only on its sizes, shard dims, world size, dtypes and the
block size, never on tensor data, so :func:`chunk_layout` and :func:`gather_layout`
are ``functools.lru_cache``'d on those, and :func:`device_tables` caches the
layout's tables as device tensors. Nothing here is rebuilt per call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_traceable.sizes import COPY_OUT_ALIGN_BYTES, aligned_offsets, ceil_div

from .fields import PARAM_COLS, ParamRow

# Lane indices are int32 inside the kernels; larger parameters take the aten path.
MAX_INDEX = 2**31 - 1
DEFAULT_BLOCK = 1024
# The copy-out kernel zeroes at most 16 gap elements after each parameter.
assert COPY_OUT_ALIGN_BYTES <= 16


@dataclass(frozen=True)
class ChunkLayout:
    """Where each parameter's elements sit in the packed ``[world, row_numel]`` buffer.

    ``params`` holds one :class:`~triton_kernels.fields.ParamRow` per parameter (the
    rows of the kernels' metadata table). ``blocks`` is the flat ``(param, first
    element)`` list, one pair per program along grid axis 0.
    """

    world_size: int
    block: int
    row_numel: int
    out_numel: int
    params: tuple[ParamRow, ...]
    blocks: tuple[int, ...]
    fits_int32: bool

    @property
    def num_blocks(self) -> int:
        return len(self.blocks) // 2

    @property
    def out_offsets(self) -> tuple[int, ...]:
        return tuple(row.out_offset for row in self.params)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(row.numel for row in self.params)


def _build(
    world_size: int,
    segments: Sequence[tuple[int, int, int]],
    kinds: Sequence[int],
    block: int,
    out_align: int,
) -> ChunkLayout:
    """``segments``: per parameter ``(seg_numel, chunk_numel, numel)``."""
    out_offsets, out = aligned_offsets([numel for _, _, numel in segments], out_align)
    ends = out_offsets[1:] + [out]
    params, blocks = [], []
    col, fits = 0, True
    for index, ((seg, chunk, numel), kind) in enumerate(zip(segments, kinds)):
        gap = ends[index] - out_offsets[index] - numel
        params.append(ParamRow(col, seg, chunk, numel, out_offsets[index], kind, gap))
        for start in range(0, seg, block):
            blocks += (index, start)
        # Largest lane index: (outer * world + rank) * chunk + rem, plus a block of slack.
        fits &= max(world_size * seg, numel) + world_size * block <= MAX_INDEX
        col += seg
    fits &= len(blocks) // 2 <= MAX_INDEX
    return ChunkLayout(world_size, block, col, out, tuple(params), tuple(blocks), fits)


@functools.lru_cache(maxsize=1024)
def gather_layout(
    numels: tuple[int, ...],
    padded_numels: tuple[int, ...],
    kinds: tuple[int, ...],
    block: int = DEFAULT_BLOCK,
) -> ChunkLayout:
    """Layout of the all-gather copy-in: one row, shard ``p`` in a segment of
    ``padded_numels[p]`` elements whose first ``numels[p]`` come from the shard.

    Args:
        numels: elements of each shard (in the unit the kernel copies).
        padded_numels: each shard's padded size in the flat all-gather input.
        kinds: each shard's source kind (``kernels.KIND_*``).
        block: elements per program.

    Returns:
        The cached :class:`ChunkLayout`.
    """
    segments = [(padded, max(padded, 1), numel) for numel, padded in zip(numels, padded_numels)]
    return _build(1, segments, kinds, block, 1)


@functools.lru_cache(maxsize=1024)
def chunk_layout(
    global_sizes: tuple[tuple[int, ...], ...],
    shard_dims: tuple[int, ...],
    world_size: int,
    kinds: tuple[int, ...],
    block: int = DEFAULT_BLOCK,
    units: tuple[int, ...] | None = None,
    out_align: int = 1,
) -> ChunkLayout:
    """Layout of the chunk-cat buffer ``torch._chunk_cat(dim0_grads, 0, world)`` and
    of the all-gather output: ``Shard(0)`` parameters pad dim 0 to
    ``ceil(size(0) / world)`` rows per rank, ``Shard(d > 0)`` ones contribute their
    ``d``-chunks.

    Args:
        global_sizes: each parameter's unsharded size.
        shard_dims: each parameter's shard dim.
        world_size: number of ranks (chunks).
        kinds: each parameter's source kind (``kernels.KIND_*``).
        block: elements per program.
        units: copy units per element of each parameter (its itemsize when a
            mixed-dtype bucket travels as bytes); ``None`` means 1 each.
        out_align: each parameter's offset in the flat unsharded output is rounded
            up to a multiple of this many units.

    Returns:
        The cached :class:`ChunkLayout`.
    """
    segments = []
    for index, (size, dim) in enumerate(zip(global_sizes, shard_dims)):
        unit = units[index] if units is not None else 1
        rows = ceil_div(size[dim], world_size)
        inner = math.prod(size[dim + 1 :]) * unit
        outer = math.prod(size[:dim])
        segments.append((outer * rows * inner, rows * inner, math.prod(size) * unit))
    return _build(world_size, segments, kinds, block, out_align)


# Keyed by the layout's identity: layouts come from the lru_caches above, and hashing
# one (its block list can be long) on every call would cost more than the launch.
_DEVICE_TABLES: dict[tuple[int, torch.device], tuple[ChunkLayout, torch.Tensor, torch.Tensor]] = {}


def device_tables(layout: ChunkLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's ``(param_meta int64 [P, PARAM_COLS], block_table int32 [nblocks, 2])`` on
    ``device``, built on the first call for this layout and device and cached."""
    key = (id(layout), device)
    entry = _DEVICE_TABLES.get(key)
    if entry is None or entry[0] is not layout:
        entry = (layout, *make_tables(layout, device))
        _DEVICE_TABLES[key] = entry
    return entry[1], entry[2]


def make_tables(layout: ChunkLayout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ``(param_meta, block_table)`` tensors on ``device``."""
    meta = torch.tensor(layout.params, dtype=torch.int64, device=device).view(-1, PARAM_COLS)
    blocks = torch.tensor(layout.blocks, dtype=torch.int32, device=device).view(-1, 2)
    return meta, blocks
