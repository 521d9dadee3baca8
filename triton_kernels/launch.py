"""Kernel launches for :mod:`.ops`: which kernel, which tables, how
many programs (the arguments themselves: :mod:`.launch_args`).

Every launch reads the layout's metadata tables (built once per layout and device,
:func:`triton_kernels.layout.device_tables`); the pack kernel reads its sources
through a table of data pointers (cached per set of addresses). A launch runs a
persistent grid: at most :data:`PROGRAMS_PER_SM` programs per SM (the Triton
interpreter: :data:`INTERPRETER_PROGRAMS`), each striding over the output tiles.
"""

from __future__ import annotations

import collections
import functools

import torch

from . import layout as layouts
from .launch_args import PROGRAMS_PER_SM, pack_launch, unpack_launch
from .loader import kernels_module

# Few programs in the interpreter, which runs them one by one: tests then also cover
# programs that loop over several tiles.
INTERPRETER_PROGRAMS = 3

_POINTER_TABLE_CACHE_SIZE = 64
_pointer_tables: collections.OrderedDict = collections.OrderedDict()


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
        scale_mode, scale: the pre-divide (see :func:`triton_kernels.launch_args.scale_for`).

    Raises:
        ValueError: ``dst_kind`` and the layout's source kinds disagree on a byte copy.
    """
    num_tiles = layout.world_size * layout.tiles_per_row
    if num_tiles == 0:
        return
    device = out.device
    interpret = device.type == "cpu"
    meta, tiles = layouts.device_tables(layout, layouts.PACK, device)
    args, constexprs = pack_launch(
        pointer_table(sources, device), out, meta, tiles, scale=scale,
        row_numel=layout.row_numel, tiles_per_row=layout.tiles_per_row, num_tiles=num_tiles,
        world=layout.world_size, src_kinds=layout.src_kinds, dst_kind=dst_kind,
        scale_mode=scale_mode, interpret=interpret, tile=layout.tile)
    kernels_module(interpret).pack_tiles[(min(num_tiles, max_programs(device)),)](
        *args, **constexprs)


def launch_unpack(source: torch.Tensor, target: torch.Tensor, layout: layouts.ChunkLayout) -> None:
    """Launches the copy-out kernel from ``source`` (``[world, row_numel]``) into
    ``target`` (the flat unsharded buffer), both integer views of one element size."""
    if layout.out_tiles == 0:
        return
    device = source.device
    meta, tiles = layouts.device_tables(layout, layouts.UNPACK, device)
    args, constexprs = unpack_launch(
        source, target, meta, tiles, row_numel=layout.row_numel, out_numel=layout.out_numel,
        num_tiles=layout.out_tiles, world=layout.world_size, tile=layout.tile)
    kernels_module(device.type == "cpu").unpack_tiles[(min(layout.out_tiles, max_programs(device)),)](
        *args, **constexprs)

