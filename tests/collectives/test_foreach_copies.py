"""The FSDP2-style foreach copies against the aten ops, bit for bit."""

from __future__ import annotations

import pytest
import torch

from fsdp_traceable.collectives import foreach_copies
from tests.collectives.copy_cases import (
    assert_same_bits,
    bucket,
    copy_out_args,
    full_tensors,
    gathered,
    rank_shards,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
CASTS = [(F32, BF16), (F32, F16), (BF16, F32), (F32, F32)]
MIXED = [F32, BF16, F16]


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_all_gather_copy_in_matches_aten(world_size):
    params = bucket(world_size)
    for src, dst in CASTS + [("mixed", BF16), ("mixed", torch.uint8)]:
        dtypes = [MIXED[i % 3] if src == "mixed" else src for i in range(len(params))]
        fulls = full_tensors(params, dtypes)
        for rank in range(world_size):
            shards, padded = rank_shards(params, fulls, world_size, rank)
            actual = foreach_copies.all_gather_copy_in(shards, padded, dst)
            expected = torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, dst)
            assert_same_bits(actual, expected)


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_all_gather_copy_out_matches_aten(world_size):
    params = bucket(world_size)
    sizes_flat, ndims, dims = copy_out_args(params, world_size)
    for dtypes, gather_dtype in [([BF16] * len(params), BF16), ([F32] * len(params), F32),
                                 ([MIXED[i % 3] for i in range(len(params))], torch.uint8)]:
        fulls = full_tensors(params, dtypes)
        output = gathered(params, fulls, world_size, gather_dtype)
        actual = foreach_copies.all_gather_copy_out(output, world_size, sizes_flat, ndims, dims, dtypes)
        expected = torch.ops.fsdp_traceable.all_gather_copy_out(
            output, world_size, sizes_flat, ndims, dims, dtypes)
        for out, ref, full in zip(actual, expected, fulls):
            assert out.is_contiguous()
            assert_same_bits(out, ref, nan_payloads=True)
            assert_same_bits(out, full, nan_payloads=True)


@pytest.mark.parametrize("world_size", (1, 2, 3, 4))
def test_reduce_scatter_copy_in_matches_aten(world_size):
    params = bucket(world_size)
    dims = [p.shard_dim for p in params]
    for src, dst in CASTS:
        grads = full_tensors(params, [src] * len(params), seed=world_size)
        for predivide in (None, 3.0):
            actual = foreach_copies.reduce_scatter_copy_in(grads, world_size, dims, dst, predivide)
            expected = torch.ops.fsdp_traceable.reduce_scatter_copy_in(
                grads, world_size, dims, dst, predivide)
            assert_same_bits(actual, expected)


def test_reduce_scatter_copy_in_all_empty():
    grads = [torch.empty(0, 3), torch.empty(0)]
    out = foreach_copies.reduce_scatter_copy_in(grads, 2, [0, 0], BF16, 2.0)
    assert out.dtype == BF16 and out.numel() == 0
