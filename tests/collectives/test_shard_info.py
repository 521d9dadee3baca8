"""make_shard_info against torch FSDP2's own layout math, and its input checks."""

from __future__ import annotations

import math

import pytest
import torch
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.fsdp._fully_shard._fsdp_common import (
    _chunk_with_empty,
    _get_dim_chunked_size,
)

from fsdp_traceable import make_shard_info, shard_tensor

WORLD_SIZES = (1, 2, 3, 4, 5, 7, 8, 16)

# Prime dim-0 sizes, numel < world, empty parameters (zero in dim 0 or elsewhere), one element.
DIM0_SIZES = (
    (1,), (2,), (3,), (7,), (13,), (31, 2), (17, 3), (5, 4), (3, 2, 5), (1, 1, 1),
    (0,), (0, 4), (4, 0), (2, 0), (9, 0, 2),
)


def fsdp2_layout(
    global_size: tuple[int, ...], world_size: int, rank: int, shard_dim: int
) -> tuple[torch.Size, torch.Size]:
    """(sharded size, padded sharded size) as FSDPParam._init_sharded_param computes them."""
    param = torch.empty(global_size, device="meta")
    chunks = _chunk_with_empty(param, world_size, dim=shard_dim)
    sharded = _get_dim_chunked_size(chunks[rank], param.size(), dim=shard_dim)
    return torch.Size(sharded), chunks[0].size()


def shard1_sizes(world_size: int) -> list[tuple[int, ...]]:
    """Sizes whose dim 1 divides evenly by ``world_size`` (FSDP2 requires it for Shard(1))."""
    return [(3, world_size), (5, 2 * world_size), (1, 3 * world_size, 2), (2, 0), (0, world_size)]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_dim0_sizes_match_fsdp2(world_size: int) -> None:
    for size in DIM0_SIZES:
        for rank in range(world_size):
            info = make_shard_info(size, world_size, rank)
            sharded, padded = fsdp2_layout(size, world_size, rank, 0)
            assert info.sharded_size == sharded, (size, world_size, rank)
            assert info.padded_sharded_size == padded, (size, world_size, rank)
            assert info.contiguous_sharded_stride == tuple(make_contiguous_strides_for(sharded))
            assert info.global_size == torch.Size(size)
            assert info.sharded_numel == math.prod(sharded)
            assert info.padded_sharded_numel == math.prod(padded)
            assert info.global_numel == math.prod(size)


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 8))
def test_shard1_sizes_match_fsdp2(world_size: int) -> None:
    for size in shard1_sizes(world_size):
        for rank in range(world_size):
            info = make_shard_info(size, world_size, rank, shard_dim=1)
            sharded, padded = fsdp2_layout(size, world_size, rank, 1)
            assert info.shard_dim == 1
            assert info.sharded_size == sharded, (size, world_size, rank)
            assert info.padded_sharded_size == padded, (size, world_size, rank)
            assert info.contiguous_sharded_stride == tuple(make_contiguous_strides_for(sharded))


def test_rank_chunks_cover_dim0_exactly_once() -> None:
    # Real rows sum to dim 0 and never exceed the padded rows; ranks fill in order.
    for world_size in WORLD_SIZES:
        for size in DIM0_SIZES:
            infos = [make_shard_info(size, world_size, r) for r in range(world_size)]
            rows = [i.sharded_size[0] for i in infos]
            if math.prod(size) > 0:
                assert sum(rows) == size[0]
            assert all(r <= infos[0].padded_sharded_size[0] for r in rows)
            assert rows == sorted(rows, reverse=True)


@pytest.mark.parametrize("world_size", (1, 2, 3, 4, 8))
def test_shard_tensor_matches_torch_chunk(world_size: int) -> None:
    for size, shard_dim in [(s, 0) for s in DIM0_SIZES] + [
        (s, 1) for s in shard1_sizes(world_size)
    ]:
        full = torch.arange(math.prod(size), dtype=torch.float32).view(size)
        chunks = _chunk_with_empty(full, world_size, dim=shard_dim)
        for rank in range(world_size):
            info = make_shard_info(size, world_size, rank, shard_dim=shard_dim)
            shard = shard_tensor(full, info)
            assert shard.shape == info.sharded_size
            assert shard.is_contiguous()
            assert torch.equal(shard.reshape(-1), chunks[rank].reshape(-1))


def test_negative_shard_dim_is_normalized() -> None:
    info = make_shard_info((4, 6), 2, 1, shard_dim=-1)
    assert info.shard_dim == 1
    assert info.sharded_size == torch.Size((4, 3))
    assert make_shard_info((4, 6), 2, 1, shard_dim=-2).shard_dim == 0


def test_dtype_defaults_chain() -> None:
    info = make_shard_info((4,), 2, 0, orig_dtype=torch.float16)
    assert (info.orig_dtype, info.param_dtype, info.reduce_dtype) == (torch.float16,) * 3
    info = make_shard_info((4,), 2, 0, param_dtype=torch.bfloat16)
    assert (info.orig_dtype, info.param_dtype, info.reduce_dtype) == (
        torch.float32, torch.bfloat16, torch.bfloat16,
    )
    info = make_shard_info((4,), 2, 0, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    assert info.reduce_dtype == torch.float32
    assert make_shard_info((4,), 2, 0, offload_to_cpu=True).offload_to_cpu


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(world_size=0, rank=0), r"world_size must be a positive int, got 0"),
        (dict(world_size=-2, rank=0), r"world_size must be a positive int, got -2"),
        (dict(world_size=2.0, rank=0), r"world_size must be a positive int, got 2\.0"),
        (dict(world_size=4, rank=-1), r"rank must be in \[0, 4\), got -1"),
        (dict(world_size=4, rank=4), r"rank must be in \[0, 4\), got 4"),
        (dict(world_size=4, rank=1.0), r"rank must be in \[0, 4\), got 1\.0"),
    ],
)
def test_bad_world_size_or_rank(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make_shard_info((8, 2), **kwargs)


@pytest.mark.parametrize("shard_dim", (2, 5, -3))
def test_shard_dim_out_of_range(shard_dim: int) -> None:
    match = rf"shard_dim={shard_dim} is out of range for a 2-dim parameter of size \(8, 2\)"
    with pytest.raises(ValueError, match=match):
        make_shard_info((8, 2), 2, 0, shard_dim=shard_dim)


def test_zero_dim_parameter() -> None:
    match = r"global_size must have at least one dim.*reshape it to \(1,\)"
    with pytest.raises(ValueError, match=match):
        make_shard_info((), 2, 0)


@pytest.mark.parametrize(
    "size, shard_dim, world_size, match",
    [
        ((4, 5), 1, 2, r"Shard\(1\) of a parameter of size \(4, 5\) needs size\(1\)=5 "
                       r"divisible by the world size 2"),
        ((2, 2, 3), 2, 2, r"Shard\(2\) .* size\(2\)=3 divisible by the world size 2"),
        ((8, 3), -1, 4, r"Shard\(1\) .* size\(1\)=3 divisible by the world size 4.*Shard\(0\)"),
    ],
)
def test_uneven_shard_on_nonzero_dim(
    size: tuple[int, ...], shard_dim: int, world_size: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_shard_info(size, world_size, 0, shard_dim=shard_dim)


def test_uneven_dim0_is_allowed() -> None:
    # Only Shard(d > 0) must be even; dim 0 pads (same inputs as the failing case above).
    assert make_shard_info((5, 4), 2, 1).sharded_size == torch.Size((2, 4))


@pytest.mark.parametrize(
    "kwargs, name, dtype",
    [
        (dict(orig_dtype=torch.int64, param_dtype=torch.bfloat16), "orig_dtype", torch.int64),
        (dict(orig_dtype=torch.complex64, param_dtype=torch.float32), "orig_dtype",
         torch.complex64),
        (dict(param_dtype=torch.int16), "param_dtype", torch.int16),
        (dict(reduce_dtype=torch.uint8), "reduce_dtype", torch.uint8),
        (dict(orig_dtype=torch.bool, reduce_dtype=torch.float32), "orig_dtype", torch.bool),
        (dict(orig_dtype=torch.float8_e4m3fn, reduce_dtype=torch.float32), "param_dtype",
         torch.float8_e4m3fn),
    ],
)
def test_unsupported_dtypes(kwargs: dict, name: str, dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match=rf"{name}={dtype} is not supported.*torch\.float32"):
        make_shard_info((4,), 2, 0, **kwargs)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.float8_e4m3fn])
def test_any_dtype_is_gathered_as_is(dtype: torch.dtype) -> None:
    # As FSDP2 gathers a frozen integer or float8 parameter: no cast, never reduced.
    info = make_shard_info((5,), 2, 1, orig_dtype=dtype)
    assert (info.param_dtype, info.reduce_dtype, info.sharded_size) == (dtype, dtype, (2,))
