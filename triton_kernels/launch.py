"""Kernel launches for :mod:`triton_kernels.ops`: which kernel, which arguments.

Eager launches use the table-driven kernels of ``kernels.py`` (metadata tables cached
per bucket layout, sources through a table of data pointers cached per set of
addresses); traced launches, and eager ones with :data:`always_generated_kernels`,
use the per-bucket kernels of :mod:`triton_kernels.codegen`.
"""

from __future__ import annotations

import collections
import contextlib
import struct
from collections.abc import Iterator

import torch
from torch.library import wrap_triton

from . import layout as layouts
from .codegen import MAX_GENERATED_SOURCES, pack_kernel, unpack_kernel
from .fields import (
    KIND_BF16,
    KIND_BYTES,
    KIND_F16,
    KIND_F32,
    SCALE_DIVIDE,
    SCALE_NONE,
    SCALE_RECIPROCAL,
)
from .loader import kernels_module

_POINTER_TABLE_CACHE_SIZE = 64
_pointer_tables: collections.OrderedDict = collections.OrderedDict()

# True runs the generated (traced-path) kernels eagerly too: how the tests check them
# under the CPU interpreter and the benchmarks time them (see generated_kernels_in_eager).
always_generated_kernels = False


@contextlib.contextmanager
def generated_kernels_in_eager(enabled: bool = True) -> Iterator[None]:
    """Eager launches in the block use the generated (traced-path) kernels."""
    global always_generated_kernels
    saved, always_generated_kernels = always_generated_kernels, enabled
    try:
        yield
    finally:
        always_generated_kernels = saved


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
    key = (device, tuple(t.data_ptr() for t in tensors))
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


def _launcher(kernel, traced: bool):
    """``kernel`` wrapped for tracing (a graph node) when traced, else itself: the
    wrapper's eager dispatch costs far more than the launch."""
    return wrap_triton(kernel) if traced else kernel


def traced_fallback(tensors: list[torch.Tensor]) -> bool:
    """Whether a traced copy-in takes the aten decomposition: on CPU (Triton kernels
    cannot run under ``torch.compile`` there) and beyond the generated kernels' size."""
    return tensors[0].device.type == "cpu" or len(tensors) > MAX_GENERATED_SOURCES


def launch_pack(
    sources: list[torch.Tensor],
    out: torch.Tensor,
    layout: layouts.ChunkLayout,
    dst_kind: int,
    scale_mode: int,
    scale: float,
    traced: bool,
) -> None:
    """Launches the pack kernel writing ``layout``'s ``[world, row_numel]`` into ``out``."""
    if layout.num_blocks == 0:
        return
    device = out.device
    interpret = device.type == "cpu"
    grid = (layout.num_blocks, layout.world_size)
    kinds = [row.src_kind for row in layout.params]
    if traced or (always_generated_kernels and len(sources) <= MAX_GENERATED_SOURCES):
        kernel = pack_kernel(layout, len(sources), dst_kind == KIND_BYTES, interpret)
        _launcher(kernel, traced)[grid](
            out, scale, *sources, DST=dst_kind, MANUAL_CASTS=interpret, SCALE_MODE=scale_mode)
        return
    meta, blocks = layouts.device_tables(layout, device)
    addresses = pointer_table(sources, device)
    module = kernels_module(interpret)
    if dst_kind == KIND_BYTES:
        module.pack_bytes_from_pointer_table[grid](
            addresses, out, meta, blocks, layout.row_numel, layout.world_size, BLOCK=layout.block,
        )
        return
    module.pack_from_pointer_table[grid](
        addresses, out, meta, blocks, scale, layout.row_numel, layout.world_size,
        HAS_F32=KIND_F32 in kinds, HAS_BF16=KIND_BF16 in kinds, HAS_F16=KIND_F16 in kinds,
        DST=dst_kind, MANUAL_CASTS=interpret, SCALE_MODE=scale_mode, BLOCK=layout.block,
    )


def launch_unpack(source: torch.Tensor, target: torch.Tensor, layout: layouts.ChunkLayout,
                  traced: bool) -> None:
    """Launches the copy-out kernel from ``source`` (``[world, row_numel]``) into
    ``target`` (the flat unsharded buffer), both integer views of one element size."""
    if layout.num_blocks == 0:
        return
    interpret = source.device.type == "cpu"
    grid = (layout.num_blocks, layout.world_size)
    if traced or always_generated_kernels:
        _launcher(unpack_kernel(layout, interpret), traced)[grid](source, target)
        return
    meta, blocks = layouts.device_tables(layout, source.device)
    kernels_module(interpret).unpack[grid](
        source, target, meta, blocks, layout.row_numel, layout.world_size, BLOCK=layout.block)
