"""Single-process reference math for the foreach collectives.

Ranks are simulated by slicing full tensors the way FSDP2 does (``torch.chunk`` on the
shard dim, missing chunks empty), independently of :mod:`fsdp_traceable.shard_info`.
Every rank regenerates the same full tensors from a seed, so the test process can
rebuild any rank's inputs and compute the expected outputs here.

Gradients are dyadic rationals (small integers times powers of two) whose sums over
up to four ranks are exact in the reduce dtype: the reference is then independent of
the order in which the backend sums, and the only rounding left is the one a test
asks for (a non-power-of-two divide, or a downcast).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fsdp_traceable import ShardInfo, make_shard_info

FP32, BF16, FP16 = torch.float32, torch.bfloat16, torch.float16


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a bucket: its unsharded size, placement and dtypes."""

    global_size: tuple[int, ...]
    shard_dim: int = 0
    orig_dtype: torch.dtype = FP32
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    @property
    def gather_dtype(self) -> torch.dtype:
        return self.param_dtype or self.orig_dtype

    @property
    def reduction_dtype(self) -> torch.dtype:
        return self.reduce_dtype or self.gather_dtype


# Uneven dim-0 sizes: prime rows, fewer rows than ranks, zero rows, one row; plus a
# Shard(1) parameter (dim 1 divisible by 2 and 4).
SHAPES: tuple[tuple[tuple[int, ...], int], ...] = (
    ((7, 5), 0),
    ((3,), 0),
    ((0, 4), 0),
    ((5, 8), 1),
    ((13,), 0),
    ((1, 3), 0),
)


def bucket(
    orig_dtypes: Sequence[torch.dtype] | torch.dtype,
    param_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
) -> tuple[ParamSpec, ...]:
    """The :data:`SHAPES` bucket with the given dtypes (a list cycles over the shapes).

    Args:
        orig_dtypes: one dtype for every parameter, or a list cycled over them.
        param_dtype: all-gather dtype (``None``: each parameter's orig dtype).
        reduce_dtype: reduce dtype (``None``: the param dtype).

    Returns:
        One :class:`ParamSpec` per shape.
    """
    if isinstance(orig_dtypes, torch.dtype):
        orig_dtypes = [orig_dtypes]
    return tuple(
        ParamSpec(size, dim, orig_dtypes[i % len(orig_dtypes)], param_dtype, reduce_dtype)
        for i, (size, dim) in enumerate(SHAPES)
    )


def make_infos(
    specs: Sequence[ParamSpec], world_size: int, rank: int, *, offload_to_cpu: bool = False
) -> list[ShardInfo]:
    """The library's :class:`ShardInfo` for each spec on ``rank`` of ``world_size``."""
    return [
        make_shard_info(
            s.global_size, world_size, rank, shard_dim=s.shard_dim, orig_dtype=s.orig_dtype,
            param_dtype=s.param_dtype, reduce_dtype=s.reduce_dtype,
            offload_to_cpu=offload_to_cpu,
        )
        for s in specs
    ]


def dyadic(
    size: Sequence[int], dtype: torch.dtype, seed: int, *, max_int: int = 64, max_exp: int = 0
) -> torch.Tensor:
    """Deterministic ``randint(-max_int, max_int) * 2**-randint(0, max_exp)`` of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    ints = torch.randint(-max_int, max_int + 1, tuple(size), generator=gen, dtype=torch.float64)
    exps = torch.randint(-max_exp, 1, tuple(size), generator=gen, dtype=torch.float64)
    return (ints * torch.pow(2.0, exps)).to(dtype)


def full_params(specs: Sequence[ParamSpec], seed: int) -> list[torch.Tensor]:
    """The unsharded parameters of a bucket, in their orig dtypes (same on every rank)."""
    return [
        dyadic(s.global_size, s.orig_dtype, seed * 1000 + i, max_int=1000, max_exp=10)
        for i, s in enumerate(specs)
    ]


def rank_grads(
    specs: Sequence[ParamSpec], seed: int, rank: int, *, max_int: int = 64, max_exp: int = 0
) -> list[torch.Tensor]:
    """Rank ``rank``'s unsharded gradients of a bucket, in the param dtype.

    The defaults keep sums over four ranks exact in bf16 and fp16; raise ``max_exp``
    for fp32 reductions so that a reduction in a narrower dtype would round.
    """
    return [
        dyadic(s.global_size, s.gather_dtype, (seed * 100 + rank) * 1000 + i,
               max_int=max_int, max_exp=max_exp)
        for i, s in enumerate(specs)
    ]


def chunk_shard(full: torch.Tensor, shard_dim: int, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard as FSDP2 cuts it: ``torch.chunk``, empty past the last chunk."""
    chunks = torch.chunk(full, world_size, dim=shard_dim)
    if rank < len(chunks) and full.size(shard_dim) > 0:
        return chunks[rank].contiguous()
    return full.narrow(shard_dim, 0, 0).contiguous()


def shard_all(
    fulls: Sequence[torch.Tensor], specs: Sequence[ParamSpec], world_size: int, rank: int
) -> list[torch.Tensor]:
    """:func:`chunk_shard` of every tensor of a bucket."""
    return [chunk_shard(f, s.shard_dim, world_size, rank) for f, s in zip(fulls, specs)]


def summed_grads(
    specs: Sequence[ParamSpec], seed: int, ranks: Sequence[int], **grad_kwargs: int
) -> list[torch.Tensor]:
    """Exact (float64) sum over ``ranks`` of :func:`rank_grads`."""
    per_rank = [rank_grads(specs, seed, r, **grad_kwargs) for r in ranks]
    return [sum(g[i].double() for g in per_rank) for i in range(len(specs))]


def divide(
    sums: Sequence[torch.Tensor], specs: Sequence[ParamSpec], divisor: float
) -> list[torch.Tensor]:
    """``sum / divisor`` in each reduce dtype, cast to the orig dtype: the reference for
    one gradient reduction.

    Power-of-two divisors are exact; any other divisor is one rounding of the sum
    (exact in the reduce dtype) divided in the reduce dtype.
    """
    out = []
    power_of_two = math.log2(divisor).is_integer()
    for total, spec in zip(sums, specs):
        if power_of_two:
            # Exact in float64; dividing first keeps fp16 sums that only the
            # pre-divide keeps finite from overflowing here.
            reduced = (total / divisor).to(spec.reduction_dtype)
        else:
            reduced = total.to(spec.reduction_dtype) / divisor
        out.append(reduced.to(spec.orig_dtype))
    return out


def padded_flat(
    shards: Sequence[torch.Tensor], specs: Sequence[ParamSpec], world_size: int
) -> torch.Tensor:
    """The flat reduce-scatter output layout: each shard flattened and zero-padded to
    ``ceil(size(dim) / world)`` slices of the shard dim, concatenated."""
    pieces = []
    for shard, spec in zip(shards, specs):
        size = list(spec.global_size)
        size[spec.shard_dim] = math.ceil(size[spec.shard_dim] / world_size)
        flat = shard.reshape(-1)
        pieces.append(torch.cat([flat, flat.new_zeros(math.prod(size) - flat.numel())]))
    return torch.cat(pieces)


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` reinterpreted as integers of the same width, for bitwise comparison."""
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return tensor.contiguous().view(int_dtype[tensor.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Asserts same dtype, size, device and bits (``-0.0`` differs from ``0.0``)."""
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, (
        f"{what}: size {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    assert actual.device == expected.device, f"{what}: device {actual.device} != {expected.device}"
    if not torch.equal(bits(actual), bits(expected)):
        mismatch = (bits(actual) != bits(expected)).sum().item()
        raise AssertionError(
            f"{what}: {mismatch}/{actual.numel()} elements differ\n"
            f"actual={actual}\nexpected={expected}"
        )


def assert_all_bitwise_equal(
    actual: Sequence[torch.Tensor], expected: Sequence[torch.Tensor], what: str
) -> None:
    """:func:`assert_bitwise_equal` for each pair of two equally long lists."""
    assert len(actual) == len(expected), f"{what}: {len(actual)} tensors, expected {len(expected)}"
    for i, (a, e) in enumerate(zip(actual, expected)):
        assert_bitwise_equal(a, e, f"{what}[{i}]")
