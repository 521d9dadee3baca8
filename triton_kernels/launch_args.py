"""What each kernel launch passes: the one place that turns a launch's inputs into the
kernel's arguments and constexprs.

:mod:`.launch` launches with these on real tensors, and the GPU target
check (``tests/triton_kernels/cuda_variants.py``, ``gpu_targets.py``) binds
them, on stand-in tensors, to the compiled kernels' signatures, so a constexpr or
argument added here reaches both. Torch-free.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from typing import Any

from .fields import (
    KIND_BF16,
    KIND_BYTES,
    KIND_F16,
    KIND_F32,
    SCALE_DIVIDE,
    SCALE_NONE,
    SCALE_RECIPROCAL,
)

NUM_WARPS = 4
# Programs of a persistent launch per SM (see :func:`triton_kernels.launch.max_programs`).
PROGRAMS_PER_SM = 4
PACK_KERNEL, UNPACK_KERNEL = "pack_tiles", "unpack_tiles"

LaunchArgs = tuple[tuple[Any, ...], dict[str, Any]]


def scale_for(predivide_factor: float | None, device_type: str) -> tuple[int, float]:
    """The pack kernel's SCALE_MODE and scalar, following torch's division of a tensor
    by a Python number: CUDA multiplies by the fp32 reciprocal, the CPU divides.

    Args:
        predivide_factor: divide by this (``None``: no divide).
        device_type: the output's ``device.type``.

    Returns:
        ``(SCALE_MODE, scale)``.
    """
    if predivide_factor is None:
        return SCALE_NONE, 1.0
    factor = to_f32(predivide_factor)
    if device_type == "cpu":
        return SCALE_DIVIDE, factor
    # Double rounding of a quotient through float64 is innocuous: this is 1.0f / factor.
    return SCALE_RECIPROCAL, to_f32(1.0 / factor)


def to_f32(value: float) -> float:
    """``value`` rounded to the nearest fp32."""
    return struct.unpack("f", struct.pack("f", value))[0]


def pack_launch(
    src_addresses: Any, out: Any, param_meta: Any, tiles: Any, *, scale: float,
    row_numel: int, tiles_per_row: int, num_tiles: int, world: int,
    src_kinds: Collection[int], dst_kind: int, scale_mode: int, interpret: bool, tile: int,
) -> LaunchArgs:
    """Positional arguments and keyword constexprs/options of a ``pack_tiles`` launch.

    Args:
        src_addresses, out, param_meta, tiles: the tensors (see ``kernels.pack_tiles``).
        scale, row_numel, tiles_per_row, num_tiles, world: the scalar arguments.
        src_kinds: the sources' element kinds (``{KIND_BYTES}`` for a byte copy).
        dst_kind: ``out``'s element kind.
        scale_mode: the pre-divide (see :func:`scale_for`).
        interpret: whether the kernel runs in the Triton interpreter (casts by hand).
        tile: elements per output tile.

    Returns:
        ``(args, kwargs)`` for ``pack_tiles[grid](*args, **kwargs)``.

    Raises:
        ValueError: a byte copy with float sources or a pre-divide, or a cast with byte
            sources.
    """
    if dst_kind == KIND_BYTES:
        if set(src_kinds) != {KIND_BYTES} or scale_mode != SCALE_NONE:
            raise ValueError(
                f"a byte copy (dst_kind KIND_BYTES) copies byte sources without a pre-divide; "
                f"got source kinds {sorted(src_kinds)}, SCALE_MODE {scale_mode}")
    elif KIND_BYTES in src_kinds:
        raise ValueError(f"a cast to dst_kind {dst_kind} needs float sources; got source "
                         f"kinds {sorted(src_kinds)}")
    args = (src_addresses, out, param_meta, tiles, scale, row_numel, tiles_per_row,
            num_tiles, world)
    constexprs = dict(
        HAS_F32=KIND_F32 in src_kinds, HAS_BF16=KIND_BF16 in src_kinds,
        HAS_F16=KIND_F16 in src_kinds, DST=dst_kind, MANUAL_CASTS=interpret,
        SCALE_MODE=scale_mode, TILE=tile, num_warps=NUM_WARPS,
    )
    return args, constexprs


def unpack_launch(
    source: Any, target: Any, param_meta: Any, tiles: Any, *, row_numel: int, out_numel: int,
    num_tiles: int, world: int, tile: int,
) -> LaunchArgs:
    """Positional arguments and keyword constexprs/options of an ``unpack_tiles`` launch.

    Args:
        source, target, param_meta, tiles: the tensors (see ``kernels.unpack_tiles``).
        row_numel, out_numel, num_tiles, world: the scalar arguments.
        tile: elements per output tile.

    Returns:
        ``(args, kwargs)`` for ``unpack_tiles[grid](*args, **kwargs)``.
    """
    args = (source, target, param_meta, tiles, row_numel, out_numel, num_tiles, world)
    return args, dict(TILE=tile, num_warps=NUM_WARPS)
