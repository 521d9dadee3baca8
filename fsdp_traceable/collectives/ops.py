"""The copy ops around FSDP's collectives, as functional ``torch.ops.fsdp_traceable`` ops.

Every op takes tensors in and returns freshly allocated tensors: no ``out=`` buffers,
no outputs aliasing inputs. Each is defined with ``Library.define`` and a
``CompositeImplicitAutograd`` implementation written in plain aten ops, so

* eager runs the aten ops directly: :func:`call` skips the op's own dispatcher hop
  there (its argument conversion costs as much as the copies of a small bucket),
* FakeTensor / Meta propagation runs the same decomposition (that is the fake impl),
* under ``torch.compile`` AOTAutograd decomposes the op and Inductor fuses the whole
  copy into a single kernel per bucket, while Dynamo-level graph dumps still show
  the op by name. (Compiled, a one-dtype ``Shard(0)`` copy-out returns disjoint
  views of one fresh buffer, so that Inductor writes it with one kernel; under
  forward regions, and in compiled autograd's graph, each parameter gets its own
  buffer, since a region's inputs may not share storage: see [Note: forward
  regions] and :func:`fresh_outputs_needed`.)

Per-parameter sizes travel as flat int lists (``sizes_flat`` + ``ndims``) because
schemas have no nested lists.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..sizes import padded_sharded_size, unflatten_sizes
from ..tracing import compiled_autograd_tracing, forward_regions_in_use, is_tracing

_lib = torch.library.Library("fsdp_traceable", "DEF")

_lib.define(
    "all_gather_copy_in(Tensor[] shards, SymInt[] padded_numels, ScalarType dtype) -> Tensor"
)
_lib.define(
    "all_gather_copy_out(Tensor all_gather_output, int world_size, SymInt[] global_sizes_flat, "
    "int[] ndims, int[] shard_dims, ScalarType[] dtypes) -> Tensor[]"
)
_lib.define(
    "reduce_scatter_copy_in(Tensor[] grads, int world_size, int[] shard_dims, "
    "ScalarType reduce_dtype, float? predivide_factor) -> Tensor"
)
_lib.define(
    "reduce_scatter_view_out(Tensor reduce_output, SymInt[] sharded_sizes_flat, int[] ndims, "
    "SymInt[] padded_sharded_numels, ScalarType orig_dtype, float? postdivide_factor) -> Tensor[]"
)


# c10::ScalarType codes of the dtypes a bucket can carry. Some torch releases (2.11) hand
# a Python kernel a ``ScalarType[]`` argument as these ints rather than as torch.dtypes
# (a single ``ScalarType`` arrives as a dtype in every release).
_SCALAR_TYPE_DTYPES = {
    0: torch.uint8, 1: torch.int8, 5: torch.float16, 6: torch.float32, 7: torch.float64,
    15: torch.bfloat16, 23: torch.float8_e5m2, 24: torch.float8_e4m3fn,
}


def as_dtypes(dtypes: Sequence[torch.dtype | int]) -> list[torch.dtype]:
    """``dtypes`` as torch.dtypes, whichever form the dispatcher delivered them in."""
    return [_SCALAR_TYPE_DTYPES[d] if isinstance(d, int) else d for d in dtypes]


def copy_out_layout(
    world_size: int,
    global_sizes_flat: Sequence[int],
    ndims: Sequence[int],
    shard_dims: Sequence[int],
    dtypes: Sequence[torch.dtype],
    as_bytes: bool,
) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """``(global_sizes, padded_sizes, split_sizes)`` of an all-gather output: each
    parameter's unsharded size, one rank's padded shard size, and its columns in the
    ``[world_size, numel]`` view (bytes when ``as_bytes``)."""
    global_sizes = unflatten_sizes(global_sizes_flat, ndims)
    padded_sizes = [
        padded_sharded_size(size, dim, world_size) for size, dim in zip(global_sizes, shard_dims)
    ]
    split_sizes = [
        math.prod(size) * (dtype.itemsize if as_bytes else 1)
        for size, dtype in zip(padded_sizes, dtypes)
    ]
    return global_sizes, padded_sizes, split_sizes


def nonempty_chunks_to_dim0(
    grads: Sequence[torch.Tensor], world_size: int, shard_dims: Sequence[int]
) -> list[torch.Tensor]:
    """The non-empty gradients, ``Shard(d > 0)`` ones with their ``d``-chunks stacked
    along dim 0: the layout ``torch._chunk_cat(..., 0, world_size)`` splits per rank.
    Empty gradients hold no elements on any rank, and ``_chunk_cat`` rejects them."""
    return [
        grad if shard_dim == 0 else torch.cat(torch.chunk(grad, world_size, dim=shard_dim))
        for grad, shard_dim in zip(grads, shard_dims)
        if grad.numel() > 0
    ]


@torch.library.impl(_lib, "all_gather_copy_in", "CompositeImplicitAutograd")
def _all_gather_copy_in(
    shards: list[torch.Tensor], padded_numels: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """:meth:`~.copy_contract.CopyOps.all_gather_copy_in`: one ``cat``."""
    return torch.cat(_copy_in_pieces(shards, padded_numels, dtype))


def all_gather_copy_in_into(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor
) -> None:
    """:meth:`~.copy_contract.CopyOps.all_gather_copy_in_into`: the same pieces, one
    ``cat(out=)``."""
    torch.cat(_copy_in_pieces(shards, padded_numels, out.dtype), out=out)


def _copy_in_pieces(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
) -> list[torch.Tensor]:
    # Eager cost is per-op dispatch for small shards: no-op casts are skipped, and the
    # padding is a zero piece of its own in the one cat (constant_pad_nd would copy
    # the shard an extra time). Inductor fuses the cat, zeros included, into one kernel.
    pieces = []
    for shard, padded_numel in zip(shards, padded_numels):
        flat = shard.reshape(-1)
        if dtype == torch.uint8 and shard.dtype != torch.uint8:
            padded_numel = padded_numel * shard.element_size()
            flat = flat.view(torch.uint8)
        elif flat.dtype != dtype:
            flat = flat.to(dtype)
        pieces.append(flat)
        pad = padded_numel - flat.numel()
        if pad:
            pieces.append(flat.new_zeros(pad))
    return pieces


@torch.library.impl(_lib, "all_gather_copy_out", "CompositeImplicitAutograd")
def _all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    global_sizes_flat: list[int],
    ndims: list[int],
    shard_dims: list[int],
    dtypes: list[torch.dtype],
) -> list[torch.Tensor]:
    """:meth:`~.copy_contract.CopyOps.all_gather_copy_out` in plain aten ops."""
    dtypes = as_dtypes(dtypes)
    as_bytes = all_gather_output.dtype == torch.uint8
    global_sizes, padded_sizes, split_sizes = copy_out_layout(
        world_size, global_sizes_flat, ndims, shard_dims, dtypes, as_bytes
    )
    rank_major = all_gather_output.view(world_size, -1)
    if not as_bytes and not any(shard_dims):
        # The common bucket (one dtype, all Shard(0)). Eager: every copy in one aten
        # call, a C++ loop, where per-op dispatch dominates small parameters; its
        # outputs are always fresh tensors.
        if torch.compiler.is_compiling() and not fresh_outputs_needed():
            stacked_all = _param_major_copy_out(rank_major, split_sizes)
        else:
            stacked_all = torch.split_with_sizes_copy(rank_major, split_sizes, dim=1)
        return [
            _strip_dim0_padding(stacked, global_size, padded_size, world_size)
            for stacked, global_size, padded_size in zip(stacked_all, global_sizes, padded_sizes)
        ]
    outputs = []
    for chunk, global_size, padded_size, shard_dim, dtype in zip(
        rank_major.split(split_sizes, dim=1), global_sizes, padded_sizes, shard_dims, dtypes
    ):
        # One copy per parameter (two for Shard(d > 0) in a byte bucket), always a
        # clone: .contiguous() returns an already contiguous chunk itself (one rank, one
        # parameter) and the output would alias the op's input.
        stacked_size = [world_size] + padded_size
        if as_bytes and dtype != torch.uint8 and chunk.numel() == 0:
            # No bytes to reinterpret. Some Inductor releases (2.11) also fail to lower
            # a dtype view of an empty buffer ("stride(-1) must be 1"), flat or not.
            stacked = chunk.new_empty(stacked_size, dtype=dtype)
        elif as_bytes and dtype != torch.uint8:
            # Flat first: a (world, 0) chunk's strides reject a dtype view.
            fresh = chunk.clone(memory_format=torch.contiguous_format).view(-1).view(dtype)
            stacked = fresh.view(stacked_size)
        elif shard_dim == 0:
            stacked = chunk.clone(memory_format=torch.contiguous_format)
        else:
            stacked = chunk.view(stacked_size)  # still a view of the input: copied below
        if shard_dim == 0:
            outputs.append(_strip_dim0_padding(stacked, global_size, padded_size, world_size))
        else:
            moved = stacked.movedim(0, shard_dim)
            outputs.append(moved.clone(memory_format=torch.contiguous_format).view(global_size))
    return outputs


def fresh_outputs_needed() -> bool:
    """Whether a compiled copy-out must give each parameter its own buffer: the
    parameters go into nested compile regions, whose inputs may not share storage
    (forward regions of a whole step; compiled autograd's outlined block backwards,
    fed by the re-gather of an eager forward's saved parameters)."""
    return forward_regions_in_use() or compiled_autograd_tracing()


def _param_major_copy_out(rank_major: torch.Tensor, split_sizes: list[int]) -> list[torch.Tensor]:
    """Compiled copy-out of a one-dtype ``Shard(0)`` bucket: one buffer holding each
    parameter's ``[world_size, split]`` stack in turn, and the stacks as views of it.

    Written as one ``cat``, Inductor emits a single kernel for the group (one loop per
    parameter, each a plain copy); ``split_with_sizes_copy`` would become one copy per
    parameter, each fused into whichever kernel first reads that parameter.
    """
    world_size = rank_major.size(0)
    starts = [0, *itertools.accumulate(split_sizes)][:-1]
    flat = torch.cat([
        rank_major[:, start : start + split].reshape(-1)
        for start, split in zip(starts, split_sizes)
    ])
    return [
        flat[world_size * start : world_size * (start + split)].view(world_size, split)
        for start, split in zip(starts, split_sizes)
    ]


def _strip_dim0_padding(
    stacked: torch.Tensor, global_size: list[int], padded_size: list[int], world_size: int
) -> torch.Tensor:
    """The unsharded ``Shard(0)`` tensor in a contiguous ``[world, *padded_size]`` stack:
    its first ``global_size[0]`` rows, as a view (one or two view ops, no copy)."""
    rows = stacked.view([world_size * padded_size[0]] + padded_size[1:])
    return rows if rows.size(0) == global_size[0] else rows[: global_size[0]]


@torch.library.impl(_lib, "reduce_scatter_copy_in", "CompositeImplicitAutograd")
def _reduce_scatter_copy_in(
    grads: list[torch.Tensor],
    world_size: int,
    shard_dims: list[int],
    reduce_dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    """:meth:`~.copy_contract.CopyOps.reduce_scatter_copy_in`: ``_chunk_cat``, then the
    cast and the pre-divide (fused into the copy under Inductor)."""
    dim0_grads = nonempty_chunks_to_dim0(grads, world_size, shard_dims)
    if not dim0_grads:
        return grads[0].new_zeros(0, dtype=reduce_dtype)
    packed = torch._chunk_cat(dim0_grads, 0, world_size).to(reduce_dtype)
    if predivide_factor is not None:
        packed = packed.div(predivide_factor)
    return packed.view(-1)


@torch.library.impl(_lib, "reduce_scatter_view_out", "CompositeImplicitAutograd")
def _reduce_scatter_view_out(
    reduce_output: torch.Tensor,
    sharded_sizes_flat: list[int],
    ndims: list[int],
    padded_sharded_numels: list[int],
    orig_dtype: torch.dtype,
    postdivide_factor: float | None,
) -> list[torch.Tensor]:
    """Splits the flat reduce-scatter output into contiguous sharded gradients.

    The post-divide (in the reduce dtype) and the cast back to ``orig_dtype`` are
    fused into the per-parameter copy, so every output is a fresh tensor.
    """
    outputs = []
    pieces = reduce_output.split(padded_sharded_numels)
    for piece, size in zip(pieces, unflatten_sizes(sharded_sizes_flat, ndims)):
        grad = piece[: math.prod(size)].view(size)
        if postdivide_factor is not None:
            grad = grad.div(postdivide_factor)
        outputs.append(grad.to(orig_dtype, copy=grad.dtype == orig_dtype and postdivide_factor is None))
    return outputs


_IMPLEMENTATIONS = {
    "all_gather_copy_in": _all_gather_copy_in,
    "all_gather_copy_out": _all_gather_copy_out,
    "reduce_scatter_copy_in": _reduce_scatter_copy_in,
    "reduce_scatter_view_out": _reduce_scatter_view_out,
}


def call(name: str, *args: Any) -> Any:
    """``torch.ops.fsdp_traceable.<name>(*args)``, with the same bits either way: while
    tracing the op itself (graphs show it by name), in eager its implementation."""
    first = args[0]
    tensors = first[:1] if isinstance(first, (list, tuple)) else (first,)
    if is_tracing(tensors):
        return getattr(torch.ops.fsdp_traceable, name)(*args)
    return _IMPLEMENTATIONS[name](*args)
