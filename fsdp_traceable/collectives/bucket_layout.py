"""The derived sizes of a bucket of parameters, computed once per bucket.

[Note: bucket layouts]
The copies around a bucket's collectives take flat size lists (op schemas have no
nested lists) and per-parameter dims and dtypes. Computing them from the bucket's
:class:`~.shard_info.ShardInfo` objects at every call costs eager host time, and while
Dynamo traces a whole step it costs bytecodes per parameter per block, in every
block. A :class:`BucketLayout` computes them once: ``fully_shard``'s groups keep one
for their whole bucket; the public collectives build one per call from the infos
they are given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..sizes import flatten_sizes
from .shard_info import SUPPORTED_DTYPES, ShardInfo


@dataclass(frozen=True)
class BucketLayout:
    """The collectives' view of a bucket of :class:`ShardInfo`, one per parameter."""

    infos: tuple[ShardInfo, ...]
    world_size: int
    rank: int
    # The all-gather's dtype: the common param_dtype, or uint8 where mixed or where no
    # backend gathers it natively (e.g. float8).
    all_gather_dtype: torch.dtype
    padded_sharded_numels: tuple[int, ...]
    global_sizes_flat: tuple[int, ...]
    global_ndims: tuple[int, ...]
    sharded_sizes_flat: tuple[int, ...]
    sharded_ndims: tuple[int, ...]
    shard_dims: tuple[int, ...]
    param_dtypes: tuple[torch.dtype, ...]
    # The bucket's one reduce_dtype / orig_dtype, or None where they differ (which the
    # reduction rejects).
    reduce_dtype: torch.dtype | None
    orig_dtype: torch.dtype | None
    offload_to_cpu: tuple[bool, ...]
    # Per parameter: whether its unsharded rows are fewer than its padded shards' (a
    # Shard(0) parameter whose dim 0 does not divide by the world size), so the copy-out
    # strips padding rows.
    padded_rows: tuple[bool, ...]

    @classmethod
    def of(cls, infos: Sequence[ShardInfo]) -> BucketLayout:
        """The layout of the bucket ``infos`` (not empty)."""
        infos = tuple(infos)
        global_flat, global_ndims = flatten_sizes([info.global_size for info in infos])
        sharded_flat, sharded_ndims = flatten_sizes([info.sharded_size for info in infos])
        return cls(
            infos=infos,
            world_size=infos[0].world_size,
            rank=infos[0].rank,
            all_gather_dtype=all_gather_dtype(infos),
            padded_sharded_numels=tuple(info.padded_sharded_numel for info in infos),
            global_sizes_flat=tuple(global_flat),
            global_ndims=tuple(global_ndims),
            sharded_sizes_flat=tuple(sharded_flat),
            sharded_ndims=tuple(sharded_ndims),
            shard_dims=tuple(info.shard_dim for info in infos),
            param_dtypes=tuple(info.param_dtype for info in infos),
            reduce_dtype=_the_one({info.reduce_dtype for info in infos}),
            orig_dtype=_the_one({info.orig_dtype for info in infos}),
            offload_to_cpu=tuple(info.offload_to_cpu for info in infos),
            padded_rows=tuple(info.shard_dim == 0 and info.global_size[0] % info.world_size != 0
                              for info in infos),
        )


def all_gather_dtype(infos: Sequence[ShardInfo]) -> torch.dtype:
    """The bucket's all-gather dtype: the common ``param_dtype``, or ``uint8`` if mixed
    or if it is one no backend reduces or gathers natively (e.g. float8)."""
    dtypes = {info.param_dtype for info in infos}
    if len(dtypes) == 1 and (dtype := dtypes.pop()) in SUPPORTED_DTYPES:
        return dtype
    return torch.uint8


def _the_one(values: set[torch.dtype]) -> torch.dtype | None:
    return next(iter(values)) if len(values) == 1 else None
