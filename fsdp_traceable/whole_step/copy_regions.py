"""A bucket's copies as calls of nested compile regions, one per layout.

[Note: copy regions]
Where a whole step runs its blocks as forward regions (see [Note: forward regions] in
``fsdp/forward_regions.py``), the forward's compute is traced and compiled once, but
each block's all-gather copy-in and copy-out (one copy per parameter, and again for
the backward's re-gather) would still be decomposed by AOTAutograd and generated as
C++ or Triton loops by Inductor once per block. The copy-in and the copy-out
therefore run as calls of ``torch.compiler.nested_compile_region`` functions keyed by
the bucket's layout (world size, sizes, shard dims, dtypes): identical blocks share
one traced, compiled copy-in and copy-out, which each block calls. The collective
stays outside, in the step's graph, where the overlap pass moves it, with its copy-in
(``region_schedule``, which tells a copy region from a block's by what it reads or
feeds: a collective). The copies run under ``no_grad`` and return fresh tensors (see
``ops._all_gather_copy_out`` under regions), as a region must.

Compiled autograd's backward of a per-block compiled model does the same: each block's
backward is one region call (``fsdp_traceable.backward_regions``), and the eager hooks
it traces around those calls (each block's re-gather and reduce-scatter) run their
all-gather copy-in and copy-out and their reduce-scatter copy-in as region calls too
(``tracing.compiled_autograd_regions_in_use``), so AOTAutograd and Inductor lower and
generate each copy once, not once per block.
"""

from __future__ import annotations

import torch

from ..collectives import copy_backends
from ..collectives.bucket_layout import BucketLayout
from ..tracing import constant_result, keyed_region

# Layout signature -> small int, process-wide (a key is only compared within one trace).
_signature_ids: dict[tuple, int] = {}
_signatures: dict[int, tuple] = {}


@constant_result
def _key_id(signature: tuple) -> int:
    key = _signature_ids.setdefault(signature, len(_signature_ids))
    _signatures[key] = signature
    return key


@constant_result
def _signature(key: int) -> tuple:
    return _signatures[key]


def _copy_out(key: int, all_gather_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
    world_size, global_sizes_flat, global_ndims, shard_dims, param_dtypes, padded_rows, _ = (
        _signature(key))
    unsharded = copy_backends.all_gather_copy_out(
        all_gather_output, world_size, global_sizes_flat, global_ndims, shard_dims,
        param_dtypes)
    # An unevenly sharded parameter is the first rows of its padded copy: a view of part
    # of a buffer, which a region may not return (AOTAutograd then inlines every region
    # of the step). Its rows are copied out once more, a copy Inductor fuses with the first.
    return tuple(tensor.clone() if padded else tensor
                 for tensor, padded in zip(unsharded, padded_rows))


_copy_out_region = keyed_region(_copy_out)


def copy_out_in_region(all_gather_output: torch.Tensor, layout: BucketLayout
                       ) -> list[torch.Tensor]:
    """The unsharded parameters of ``layout``'s bucket from its all-gather output, as
    one call of the copy-out region of that layout (see [Note: copy regions]).
    Called only while a whole step traces its blocks as forward regions."""
    signature = (layout.world_size, layout.global_sizes_flat, layout.global_ndims,
                 layout.shard_dims, layout.param_dtypes, layout.padded_rows,
                 all_gather_output.dtype)
    # ``+ 0``: a fresh constant (Dynamo gives the call's result a source the region's
    # argument checks would try to guard on).
    return list(_copy_out_region(_key_id(signature) + 0, all_gather_output))


def _copy_in(key: int, *shards: torch.Tensor) -> torch.Tensor:
    padded_numels, dtype, _, _, _ = _signature(key)
    return copy_backends.all_gather_copy_in(list(shards), padded_numels, dtype)


_copy_in_region = keyed_region(_copy_in)


def copy_in_in_region(shards: list[torch.Tensor], layout: BucketLayout,
                      dtype: torch.dtype) -> torch.Tensor:
    """The all-gather input of ``layout``'s bucket from its ``shards`` (``layout``'s
    sharded sizes; ``all_gather_copy_in``), as one call of the copy-in region of that
    layout (see [Note: copy regions]). Called only while a whole step traces its blocks
    as forward regions or Dynamo traces compiled autograd's graph with backward regions.
    """
    # The shapes from the layout, the dtypes in one comprehension: Dynamo traces a
    # generator expression one frame per shard, and this runs once per block.
    shard_dtypes = tuple([shard.dtype for shard in shards])
    signature = (layout.padded_sharded_numels, dtype, layout.sharded_sizes_flat,
                 layout.sharded_ndims, shard_dtypes)
    return _copy_in_region(_key_id(signature) + 0, *shards)



def _reduce_scatter_copy_in(key: int, *grads: torch.Tensor) -> torch.Tensor:
    world_size, shard_dims, reduce_dtype, predivide_factor, _, _, _ = _signature(key)
    return copy_backends.reduce_scatter_copy_in(
        list(grads), world_size, shard_dims, reduce_dtype, predivide_factor)


_reduce_scatter_copy_in_region = keyed_region(_reduce_scatter_copy_in)


def reduce_scatter_copy_in_in_region(grads: list[torch.Tensor], layout: BucketLayout,
                                     reduce_dtype: torch.dtype,
                                     predivide_factor: float | None) -> torch.Tensor:
    """The reduce-scatter input of a bucket's unsharded ``grads`` (``layout``'s
    ``reduce_scatter_copy_in``), as one call of the copy-in region of their layout
    (see [Note: copy regions]). Called only while Dynamo traces compiled autograd's
    graph with backward regions."""
    signature = (layout.world_size, layout.shard_dims, reduce_dtype, predivide_factor,
                 layout.global_sizes_flat, layout.global_ndims, grads[0].dtype)
    return _reduce_scatter_copy_in_region(_key_id(signature) + 0, *grads)
