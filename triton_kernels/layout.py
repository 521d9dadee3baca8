"""Static per-bucket metadata for the copy kernels, computed once per bucket shape.

A bucket's layout depends only on its sizes, shard dims, world size, dtypes and the
tile size, never on tensor data, so :func:`chunk_layout` and :func:`gather_layout`
are ``functools.lru_cache``'d on those, and :func:`device_tables` caches the
layout's tables as device tensors. Nothing here is rebuilt per call.

The kernels work per fixed-size tile of their contiguous output. A tile table row
(:class:`~triton_kernels.fields.TileRow`) names the few parameters a tile touches,
so a lane only ever looks at its own tile's parameters.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_traceable.sizes import aligned_offsets, ceil_div

from .fields import DEFAULT_TILE, MAX_INDEX, PARAM_COLS, TILE_COLS, ParamRow

PACK, UNPACK = "pack", "unpack"


@dataclass(frozen=True)
class ChunkLayout:
    """Where each parameter's elements sit in the packed ``[world, row_numel]`` buffer
    and in the flat unsharded (copy-out) buffer of ``out_numel`` elements.

    ``params`` holds one :class:`~triton_kernels.fields.ParamRow` per parameter (the
    rows of the kernels' metadata table).
    """

    world_size: int
    tile: int
    row_numel: int
    out_numel: int
    params: tuple[ParamRow, ...]
    fits_int32: bool

    @property
    def out_offsets(self) -> tuple[int, ...]:
        return tuple(row.out_offset for row in self.params)

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(row.numel for row in self.params)

    @property
    def tiles_per_row(self) -> int:
        """Tiles of one rank's row of the packed buffer (the pack kernel's output)."""
        return ceil_div(self.row_numel, self.tile)

    @property
    def out_tiles(self) -> int:
        """Tiles of the flat unsharded buffer (the unpack kernel's output)."""
        return ceil_div(self.out_numel, self.tile)

    @functools.cached_property
    def src_kinds(self) -> frozenset[int]:
        return frozenset(row.src_kind for row in self.params)

    @functools.cached_property
    def pack_tiles(self) -> tuple[int, ...]:
        """Flat tile table of one packed row: ``TileRow`` per column tile."""
        spans = [(p, row.col_offset, row.col_offset + row.seg_numel)
                 for p, row in enumerate(self.params) if row.seg_numel]
        return tile_table(spans, self.row_numel, self.tile)

    @functools.cached_property
    def unpack_tiles(self) -> tuple[int, ...]:
        """Flat tile table of the unsharded buffer (gaps between parameters belong to
        no parameter: the kernel writes zeros there)."""
        spans = [(p, row.out_offset, row.out_offset + row.numel)
                 for p, row in enumerate(self.params) if row.numel]
        return tile_table(spans, self.out_numel, self.tile)


def tile_table(spans: Sequence[tuple[int, int, int]], total: int, tile: int) -> tuple[int, ...]:
    """For each tile ``[t * tile, (t + 1) * tile)`` of ``[0, total)``: the first
    parameter whose span overlaps it and how many parameter indices to look at.

    Args:
        spans: ``(param, start, end)`` of the non-empty parameters, in increasing,
            non-overlapping order.
        total: elements of the output.
        tile: elements per tile.

    Returns:
        The flat ``(first_param, param_count)`` pairs, one per tile.
    """
    table: list[int] = []
    first = 0
    for start in range(0, total, tile):
        end = start + tile
        while first < len(spans) and spans[first][2] <= start:
            first += 1
        last = first
        while last < len(spans) and spans[last][1] < end:
            last += 1
        if last > first:
            # Indices in between include the empty parameters: they match no lane.
            table += (spans[first][0], spans[last - 1][0] - spans[first][0] + 1)
        else:
            table += (0, 0)
    return tuple(table)


def _build(
    world_size: int,
    segments: Sequence[tuple[int, int, int]],
    kinds: Sequence[int],
    tile: int,
    out_align: int,
) -> ChunkLayout:
    """``segments``: per parameter ``(seg_numel, chunk_numel, numel)``."""
    out_offsets, out = aligned_offsets([numel for _, _, numel in segments], out_align)
    params = []
    col, largest = 0, 0
    for index, ((seg, chunk, numel), kind) in enumerate(zip(segments, kinds)):
        # chunk >= 1: lanes divide by it, also in parameters without elements.
        params.append(ParamRow(col, seg, max(chunk, 1), numel, out_offsets[index], kind))
        largest = max(largest, world_size * seg, numel)
        col += seg
    fits = max(world_size * col, out, largest) + tile <= MAX_INDEX
    return ChunkLayout(world_size, tile, col, out, tuple(params), fits)


@functools.lru_cache(maxsize=1024)
def gather_layout(
    numels: tuple[int, ...],
    padded_numels: tuple[int, ...],
    kinds: tuple[int, ...],
    tile: int = DEFAULT_TILE,
) -> ChunkLayout:
    """Layout of the all-gather copy-in: one row, shard ``p`` in a segment of
    ``padded_numels[p]`` elements whose first ``numels[p]`` come from the shard.

    Args:
        numels: elements of each shard (in the unit the kernel copies).
        padded_numels: each shard's padded size in the flat all-gather input.
        kinds: each shard's source kind (``fields.KIND_*``).
        tile: elements per output tile.

    Returns:
        The cached :class:`ChunkLayout`.
    """
    segments = [(padded, padded, numel) for numel, padded in zip(numels, padded_numels)]
    return _build(1, segments, kinds, tile, 1)


@functools.lru_cache(maxsize=1024)
def chunk_layout(
    global_sizes: tuple[tuple[int, ...], ...],
    shard_dims: tuple[int, ...],
    world_size: int,
    kinds: tuple[int, ...],
    tile: int = DEFAULT_TILE,
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
        kinds: each parameter's source kind (``fields.KIND_*``).
        tile: elements per output tile.
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
    return _build(world_size, segments, kinds, tile, out_align)


# Keyed by the layout's identity: layouts come from the lru_caches above, and hashing
# one (its parameter rows can be many) on every call would cost more than the launch.
_DEVICE_TABLES: dict[tuple[int, str, torch.device],
                     tuple[ChunkLayout, torch.Tensor, torch.Tensor]] = {}


def device_tables(layout: ChunkLayout, direction: str,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's metadata on ``device``, built on the first call for this layout,
    direction and device and cached.

    Args:
        layout: a layout from :func:`gather_layout` or :func:`chunk_layout`.
        direction: :data:`PACK` (tiles of the packed rows) or :data:`UNPACK` (tiles
            of the unsharded buffer).
        device: where the kernel runs.

    Returns:
        ``(param_meta int64 [P, PARAM_COLS], tiles int32 [num_tiles, TILE_COLS])``.
    """
    key = (id(layout), direction, device)
    entry = _DEVICE_TABLES.get(key)
    if entry is None or entry[0] is not layout:
        entry = (layout, *make_tables(layout, direction, device))
        _DEVICE_TABLES[key] = entry
    return entry[1], entry[2]


def make_tables(layout: ChunkLayout, direction: str,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh ``(param_meta, tiles)`` tensors on ``device`` (see :func:`device_tables`)."""
    meta = torch.tensor(layout.params, dtype=torch.int64, device=device).view(-1, PARAM_COLS)
    flat = layout.pack_tiles if direction == PACK else layout.unpack_tiles
    tiles = torch.tensor(flat, dtype=torch.int32, device=device).view(-1, TILE_COLS)
    return meta, tiles
