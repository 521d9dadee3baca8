"""Per-parameter sharding metadata: the plain-data replacement for FSDP2's ``FSDPParam``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..sizes import ceil_div, contiguous_strides

# Dtypes gloo and NCCL can all-gather and reduce; anything else is rejected up front.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@dataclass(frozen=True)
class ShardInfo:
    """How one parameter is sharded on one rank, computed once and read on every step.

    Sizes follow FSDP2: ``Shard(0)`` pads dim 0 to a multiple of the world size
    (``ceil(size(0) / world)`` rows per rank, the last ranks possibly holding fewer
    or none); ``Shard(d > 0)`` requires even sharding.
    """

    global_size: torch.Size
    shard_dim: int
    world_size: int
    rank: int
    sharded_size: torch.Size
    padded_sharded_size: torch.Size
    contiguous_sharded_stride: tuple[int, ...]
    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    orig_dtype: torch.dtype
    offload_to_cpu: bool = False

    @property
    def global_numel(self) -> int:
        return math.prod(self.global_size)

    @property
    def sharded_numel(self) -> int:
        return math.prod(self.sharded_size)

    @property
    def padded_sharded_numel(self) -> int:
        return math.prod(self.padded_sharded_size)


def make_shard_info(
    global_size: torch.Size | tuple[int, ...],
    world_size: int,
    rank: int,
    *,
    shard_dim: int = 0,
    orig_dtype: torch.dtype = torch.float32,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    offload_to_cpu: bool = False,
) -> ShardInfo:
    """Builds the :class:`ShardInfo` of one parameter.

    Args:
        global_size: the unsharded parameter's size.
        world_size: number of ranks in the shard group.
        rank: this rank's index in the shard group.
        shard_dim: the dim the parameter is sharded on (``Shard(shard_dim)``).
        orig_dtype: the sharded parameter's dtype, and the dtype of its gradient.
        param_dtype: the all-gather / compute dtype; ``None`` keeps ``orig_dtype``.
        reduce_dtype: the reduce-scatter dtype; ``None`` reduces in ``param_dtype``.
        offload_to_cpu: whether the sharded parameter and gradient live on CPU.

    Returns:
        The metadata, with sharded and padded sizes for this rank.

    Raises:
        ValueError: bad ``world_size``/``rank``/``shard_dim``, or a ``Shard(d > 0)``
            whose dim size is not divisible by ``world_size``.
        TypeError: a ``param_dtype`` or ``reduce_dtype`` that is not a floating dtype
            FSDP casts and reduces (any ``orig_dtype`` gathered as is is fine).
    """
    global_size = torch.Size(global_size)
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    ndim = len(global_size)
    if ndim == 0:
        raise ValueError(
            "global_size must have at least one dim: FSDP cannot shard a 0-dim "
            "parameter; reshape it to (1,) or leave it unsharded"
        )
    if not -ndim <= shard_dim < ndim:
        raise ValueError(
            f"shard_dim={shard_dim} is out of range for a {ndim}-dim parameter of "
            f"size {tuple(global_size)}"
        )
    shard_dim %= ndim
    param_dtype = param_dtype or orig_dtype
    reduce_dtype = reduce_dtype or param_dtype
    # Any dtype is gathered as is (as bytes where no backend gathers it natively), as
    # FSDP2 gathers a frozen integer or float8 parameter; casts and reductions take
    # floating dtypes only.
    if not (param_dtype == reduce_dtype == orig_dtype and orig_dtype not in SUPPORTED_DTYPES):
        checked = (("orig_dtype", orig_dtype, orig_dtype.is_floating_point),
                   ("param_dtype", param_dtype, param_dtype in SUPPORTED_DTYPES),
                   ("reduce_dtype", reduce_dtype, reduce_dtype in SUPPORTED_DTYPES))
        for name, dtype, ok in checked:
            if not ok:
                raise TypeError(
                    f"{name}={dtype} is not supported: FSDP casts floating-point tensors to "
                    f"and reduces them in {', '.join(map(str, SUPPORTED_DTYPES))}; a tensor of "
                    "another dtype is gathered as is (no param_dtype nor reduce_dtype)"
                )

    dim_size = global_size[shard_dim]
    if shard_dim == 0:
        rows_per_rank = ceil_div(dim_size, world_size)
        local_rows = max(0, min(rows_per_rank, dim_size - rank * rows_per_rank))
    else:
        if dim_size % world_size != 0:
            raise ValueError(
                f"Shard({shard_dim}) of a parameter of size {tuple(global_size)} needs "
                f"size({shard_dim})={dim_size} divisible by the world size {world_size}; "
                f"shard it on dim 0 instead (shard_placement_fn returning Shard(0))"
            )
        rows_per_rank = local_rows = dim_size // world_size
    if math.prod(global_size) == 0:
        # FSDP2 gives every empty shard 0 rows along the shard dim, even when the
        # parameter's zero is in another dim (its _get_dim_chunked_size).
        local_rows = 0
    sharded_size = _with_dim(global_size, shard_dim, local_rows)
    padded_sharded_size = _with_dim(global_size, shard_dim, rows_per_rank)
    return ShardInfo(
        global_size=global_size,
        shard_dim=shard_dim,
        world_size=world_size,
        rank=rank,
        sharded_size=sharded_size,
        padded_sharded_size=padded_sharded_size,
        contiguous_sharded_stride=contiguous_strides(sharded_size),
        param_dtype=param_dtype,
        reduce_dtype=reduce_dtype,
        orig_dtype=orig_dtype,
        offload_to_cpu=offload_to_cpu,
    )


def _with_dim(size: torch.Size, dim: int, value: int) -> torch.Size:
    return torch.Size(size[:dim] + (value,) + size[dim + 1 :])


def shard_tensor(full: torch.Tensor, info: ShardInfo) -> torch.Tensor:
    """This rank's shard of ``full`` under ``info``: a fresh contiguous tensor."""
    rows = info.padded_sharded_size[info.shard_dim]
    start = min(info.rank * rows, full.size(info.shard_dim))
    local = full.narrow(info.shard_dim, start, info.sharded_size[info.shard_dim])
    return local.clone(memory_format=torch.contiguous_format)
