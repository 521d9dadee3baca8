"""Kernel launches for :mod:`triton_kernels.ops`: which kernel, which arguments, how
many programs.

Every launch reads the layout's metadata tables (built once per layout and device,
:func:`triton_kernels.layout.device_tables`); the pack kernel reads its sources
through a table of data pointers (cached per set of addresses). A launch runs a
persistent grid: at most :data:`PROGRAMS_PER_SM` programs per SM (the Triton
interpreter: :data:`INTERPRETER_PROGRAMS`), each striding over the output tiles.
"""

from __future__ import annotations

import collections
import functools
import struct

import torch

from . import layout as layouts
from .fields import (
    KIND_BF16,
    KIND_F16,
    KIND_F32,
    SCALE_DIVIDE,
    SCALE_NONE,
    SCALE_RECIPROCAL,
)
from .loader import kernels_module

PROGRAMS_PER_SM = 4
NUM_WARPS = 4
# Few programs in the interpreter, which runs them one by one: tests then also cover
# programs that loop over several tiles.
INTERPRETER_PROGRAMS = 3

_POINTER_TABLE_CACHE_SIZE = 64
_pointer_tables: collections.OrderedDict = collections.OrderedDict()


def scale_for(predivide_factor: float | None, device: torch.device) -> tuple[int, float]:
    """The kernel's SCALE_MODE and scalar, following torch's division of a tensor by a
    Python number: CUDA multiplies by the fp32 reciprocal, the CPU divides."""
    if predivide_factor is None:
        return SCALE_NONE, 1.0
    factor = _to_f32(predivide_factor)
    if device.type == "cpu":
        return SCALE_DIVIDE, factor
    # Double rounding of a quotient through float64 is innocuous: this is 1.0f / factor.
    return SCALE_RECIPROCAL, _to_f32(1.0 / factor)


def _to_f32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]


def pointer_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """int64 data pointers of ``tensors`` on ``device``; cached per address tuple, which
    repeats across steps for parameters and usually for gradients."""
    key = (device, tuple(map(torch.Tensor.data_ptr, tensors)))
    table = _pointer_tables.get(key)
    if table is None:
        table = torch.tensor(key[1], dtype=torch.int64)
        if device.type != "cpu":
            # Pinned and non-blocking: a pageable copy would synchronise the stream.
            table = table.pin_memory().to(device, non_blocking=True)
        _pointer_tables[key] = table
        if len(_pointer_tables) > _POINTER_TABLE_CACHE_SIZE:
            _pointer_tables.popitem(last=False)
    else:
        _pointer_tables.move_to_end(key)
    return table


@functools.cache
def max_programs(device: torch.device) -> int:
    """Programs of a persistent launch on ``device``."""
    if device.type == "cpu":
        return INTERPRETER_PROGRAMS
    index = device.index if device.index is not None else torch.cuda.current_device()
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count


def launch_pack(
    sources: list[torch.Tensor],
    out: torch.Tensor,
    layout: layouts.ChunkLayout,
    dst_kind: int,
    scale_mode: int,
    scale: float,
) -> None:
    """Launches the pack kernel writing ``layout``'s ``[world, row_numel]`` into ``out``.

    Args:
        sources: one contiguous tensor per parameter of the layout.
        out: the contiguous output of ``world * row_numel`` elements.
        layout: the bucket's layout.
        dst_kind: ``out``'s element kind (``KIND_BYTES``: raw bytes, no cast).
        scale_mode, scale: the pre-divide (see :func:`scale_for`).
    """
    num_tiles = layout.world_size * layout.tiles_per_row
    if num_tiles == 0:
        return
    device = out.device
    interpret = device.type == "cpu"
    meta, tiles = layouts.device_tables(layout, layouts.PACK, device)
    kinds = layout.src_kinds
    kernels_module(interpret).pack_tiles[(min(num_tiles, max_programs(device)),)](
        pointer_table(sources, device), out, meta, tiles, scale, layout.row_numel,
        layout.tiles_per_row, num_tiles, layout.world_size,
        HAS_F32=KIND_F32 in kinds, HAS_BF16=KIND_BF16 in kinds, HAS_F16=KIND_F16 in kinds,
        DST=dst_kind, MANUAL_CASTS=interpret, SCALE_MODE=scale_mode, TILE=layout.tile,
        num_warps=NUM_WARPS,
    )


def launch_unpack(source: torch.Tensor, target: torch.Tensor, layout: layouts.ChunkLayout) -> None:
    """Launches the copy-out kernel from ``source`` (``[world, row_numel]``) into
    ``target`` (the flat unsharded buffer), both integer views of one element size."""
    if layout.out_tiles == 0:
        return
    device = source.device
    meta, tiles = layouts.device_tables(layout, layouts.UNPACK, device)
    kernels_module(device.type == "cpu").unpack_tiles[(min(layout.out_tiles, max_programs(device)),)](
        source, target, meta, tiles, layout.row_numel, layout.out_numel, layout.out_tiles,
        layout.world_size, TILE=layout.tile, num_warps=NUM_WARPS,
    )

