"""Size arithmetic shared by the copies, the shard metadata and the Triton layouts.

Every padded or aligned size in the library comes from these few functions, so the
aten ops, the foreach copies and the Triton kernels agree on every layout.
"""

from __future__ import annotations

from collections.abc import Sequence

# Unsharded parameters in a copy-out buffer start on this byte alignment, so a byte
# buffer (mixed-dtype bucket) can be viewed per parameter as its own dtype and
# consumers (GEMMs, vectorised kernels) see aligned parameters.
COPY_OUT_ALIGN_BYTES = 16


def ceil_div(numerator: int, denominator: int) -> int:
    """``ceil(numerator / denominator)`` for ints (symbolic ints too)."""
    return -(-numerator // denominator)


def round_up(value: int, multiple: int) -> int:
    """``value`` rounded up to a multiple of ``multiple``."""
    return ceil_div(value, multiple) * multiple


def aligned_offsets(numels: Sequence[int], align: int) -> tuple[list[int], int]:
    """Offsets of consecutive pieces of ``numels`` elements, each starting on a multiple
    of ``align``, and the end of the last piece."""
    offsets, end = [], 0
    for numel in numels:
        end = round_up(end, align)
        offsets.append(end)
        end += numel
    return offsets, end


def copy_out_align(itemsize: int, as_bytes: bool) -> int:
    """Alignment, in elements of ``itemsize`` bytes, of parameters in a copy-out buffer
    (a byte buffer counts bytes)."""
    return COPY_OUT_ALIGN_BYTES if as_bytes else max(1, COPY_OUT_ALIGN_BYTES // itemsize)


def unflatten_sizes(sizes_flat: Sequence[int], ndims: Sequence[int]) -> list[list[int]]:
    """Splits ``sizes_flat`` back into one size list per tensor (``ndims[i]`` entries each)."""
    sizes, offset = [], 0
    for ndim in ndims:
        sizes.append(list(sizes_flat[offset : offset + ndim]))
        offset += ndim
    return sizes


def flatten_sizes(sizes: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """The inverse of :func:`unflatten_sizes`: op schemas have no nested lists."""
    return [s for size in sizes for s in size], [len(size) for size in sizes]


def padded_sharded_size(global_size: Sequence[int], shard_dim: int, world_size: int) -> list[int]:
    """One rank's padded shard: ``ceil(size(shard_dim) / world_size)`` along ``shard_dim``."""
    size = list(global_size)
    size[shard_dim] = ceil_div(size[shard_dim], world_size)
    return size


def contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``size`` (as torch's, 1 for empty dims), in
    plain Python that Dynamo traces on every torch (2.11 skips a helper of torch's own)."""
    strides, multiplier = [], 1
    for length in reversed(size):
        strides.append(multiplier)
        multiplier *= max(length, 1)
    return tuple(reversed(strides))
