"""A whole step's all-gather copy-out as one call of a nested compile region per layout.

[Note: copy-out regions]
Where a whole step runs its blocks as forward regions (see [Note: forward regions] in
``fsdp/forward_regions.py``), the forward's compute is traced and compiled once, but
each block's copy-out (one copy per parameter, and again for the backward's re-gather)
would still be decomposed by AOTAutograd and generated as C++ or Triton loops by
Inductor once per block: at 8 blocks, about half the first step's growth per block.
The copy-out therefore runs as one call of a ``torch.compiler.nested_compile_region``
keyed by its bucket's layout (world size, sizes, shard dims, dtypes): identical blocks
share one traced, compiled copy-out, which each block calls. The collective stays
outside, in the step's graph, where the overlap pass moves it
(``region_schedule``, which tells a copy-out region by its input: a collective's
wait). The copy-out runs under ``no_grad`` and returns a fresh tensor per parameter
(see ``ops._all_gather_copy_out`` under regions), as a region must.
"""

from __future__ import annotations

import torch

from ..tracing import regions_available
from . import copy_backends
from .bucket_layout import BucketLayout

# Layout signature -> small int, process-wide (a key is only compared within one trace).
_signature_ids: dict[tuple, int] = {}
_signatures: dict[int, tuple] = {}


@torch._dynamo.assume_constant_result
def _key_id(signature: tuple) -> int:
    key = _signature_ids.setdefault(signature, len(_signature_ids))
    _signatures[key] = signature
    return key


@torch._dynamo.assume_constant_result
def _signature(key: int) -> tuple:
    return _signatures[key]


def _copy_out(key: int, all_gather_output: torch.Tensor) -> tuple[torch.Tensor, ...]:
    world_size, global_sizes_flat, global_ndims, shard_dims, param_dtypes, _ = _signature(key)
    unsharded = copy_backends.all_gather_copy_out(
        all_gather_output, world_size, global_sizes_flat, global_ndims, shard_dims,
        param_dtypes)
    # An unevenly sharded parameter is the first rows of its padded copy: a view of part
    # of a buffer, which a region may not return (AOTAutograd then inlines every region
    # of the step). Its rows are copied out once more, a copy Inductor fuses with the first.
    return tuple(tensor.clone() if padded else tensor
                 for tensor, padded in zip(unsharded, _padded_rows(key)))


@torch._dynamo.assume_constant_result
def _padded_rows(key: int) -> tuple[bool, ...]:
    """Per parameter of the layout ``key``: whether its copy-out strips padding rows
    (a ``Shard(0)`` parameter whose dim 0 does not divide by the world size)."""
    world_size, global_sizes_flat, global_ndims, shard_dims, _, _ = _signatures[key]
    padded, offset = [], 0
    for ndim, shard_dim in zip(global_ndims, shard_dims):
        padded.append(shard_dim == 0 and global_sizes_flat[offset] % world_size != 0)
        offset += ndim
    return tuple(padded)


def _key_of(key: int, *_: object) -> int:
    return key


# Only where forward regions can run (torch's regions take a reuse key).
_region = (torch.compiler.nested_compile_region(_copy_out, reuse_hash_fn=_key_of)
           if regions_available() else None)


def copy_out_in_region(all_gather_output: torch.Tensor, layout: BucketLayout
                       ) -> list[torch.Tensor]:
    """The unsharded parameters of ``layout``'s bucket from its all-gather output, as
    one call of the copy-out region of that layout (see [Note: copy-out regions]).
    Called only while a whole step traces its blocks as forward regions."""
    signature = (layout.world_size, layout.global_sizes_flat, layout.global_ndims,
                 layout.shard_dims, layout.param_dtypes, all_gather_output.dtype)
    # ``+ 0``: a fresh constant (Dynamo gives the call's result a source the region's
    # argument checks would try to guard on).
    return list(_region(_key_id(signature) + 0, all_gather_output))
