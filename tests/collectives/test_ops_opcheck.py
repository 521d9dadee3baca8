"""torch.library.opcheck on every fsdp_traceable op, and property tests over random buckets."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fsdp_traceable import make_shard_info, shard_tensor
from tests.collectives.test_ops import (
    DIM0_SIZES,
    MODES,
    bucket_infos,
    check_all_gather_round_trip,
    check_reduce_scatter_copy_in,
    check_view_out,
    copy_out_args,
    make_fulls,
    mode_dtypes,
    shard1_bucket,
)

ops = torch.ops.fsdp_traceable


def all_gather_args(sizes, dims, world_size, mode, rank):
    """(copy-in args on ``rank``, copy-out args of the simulated all-gather output)."""
    orig_dtypes, param_dtypes, ag_dtype = mode_dtypes(mode, len(sizes))
    fulls = make_fulls(sizes, orig_dtypes)
    inputs, copy_in_args = [], None
    for r in range(world_size):
        infos = bucket_infos(sizes, dims, world_size, r, orig_dtypes, param_dtypes)
        shards = [shard_tensor(f, i) for f, i in zip(fulls, infos)]
        args = (shards, [i.padded_sharded_numel for i in infos], ag_dtype)
        inputs.append(ops.all_gather_copy_in(*args))
        copy_in_args = args if r == rank else copy_in_args
    return copy_in_args, (torch.cat(inputs), *copy_out_args(infos))


def reduce_args(sizes, dims, world_size, grad_dtype, reduce_dtype, predivide, rank, postdivide):
    """(reduce-scatter copy-in args, view-out args on ``rank``)."""
    grads = make_fulls(sizes, [grad_dtype] * len(sizes))
    infos = [make_shard_info(s, world_size, rank, shard_dim=d) for s, d in zip(sizes, dims)]
    padded = [i.padded_sharded_numel for i in infos]
    view_out = (
        torch.randn(sum(padded)).to(reduce_dtype), [s for i in infos for s in i.sharded_size],
        [len(i.sharded_size) for i in infos], padded, grad_dtype, postdivide,
    )
    return (grads, world_size, dims, reduce_dtype, predivide), view_out


def requiring_grad(args: tuple) -> tuple:
    """``args`` with every floating tensor (also inside lists) requiring grad."""
    def mark(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            return x.detach().requires_grad_()
        if isinstance(x, list):
            return [mark(y) for y in x]
        return x
    return tuple(mark(a) for a in args)


AG_CASES = [  # (sizes, dims, world size, mode, rank)
    (DIM0_SIZES, [0] * len(DIM0_SIZES), 3, "fp32", 2),
    (DIM0_SIZES, [0] * len(DIM0_SIZES), 4, "bf16", 3),
    (DIM0_SIZES, [0] * len(DIM0_SIZES), 8, "mixed", 5),
    (*shard1_bucket(4), 4, "fp16", 1),
    (*shard1_bucket(2), 2, "mixed", 0),
    ([(5, 3)], [0], 1, "fp32", 0),
    ([(2, 6)], [1], 3, "fp32", 1),
]
RS_CASES = [  # (sizes, dims, world size, grad dtype, reduce dtype, predivide, rank, postdivide)
    (DIM0_SIZES, [0] * len(DIM0_SIZES), 3, torch.float32, torch.float32, None, 2, None),
    (DIM0_SIZES, [0] * len(DIM0_SIZES), 8, torch.bfloat16, torch.float32, 2.0, 7, 4.0),
    (*shard1_bucket(4), 4, torch.float16, torch.float16, 2.0, 1, 2.0),
    ([(6,)], [0], 1, torch.float32, torch.float32, None, 0, None),
    ([(0, 3), (2, 0)], [0, 1], 2, torch.float32, torch.bfloat16, None, 1, None),
]


@pytest.mark.parametrize("case", AG_CASES, ids=lambda c: f"w{c[2]}-{c[3]}-{len(c[0])}p")
def test_opcheck_all_gather_ops(case) -> None:
    copy_in, copy_out = all_gather_args(*case)
    torch.library.opcheck(ops.all_gather_copy_in, copy_in)
    torch.library.opcheck(ops.all_gather_copy_out, copy_out)
    if case[3] != "mixed":  # byte views carry no gradient
        torch.library.opcheck(ops.all_gather_copy_in, requiring_grad(copy_in))
        torch.library.opcheck(ops.all_gather_copy_out, requiring_grad(copy_out))


@pytest.mark.parametrize("case", RS_CASES, ids=lambda c: f"w{c[2]}-{c[3]}-{c[4]}-{len(c[0])}p")
def test_opcheck_reduce_scatter_ops(case) -> None:
    copy_in, view_out = reduce_args(*case)
    # Gradients are reduced outside autograd (aten::_chunk_cat has no derivative), so the
    # copy-in is checked without requires_grad inputs.
    torch.library.opcheck(ops.reduce_scatter_copy_in, copy_in)
    for args in (view_out, requiring_grad(view_out)):
        torch.library.opcheck(ops.reduce_scatter_view_out, args)


@st.composite
def buckets(draw) -> tuple[list[tuple[int, ...]], list[int], int]:
    """A random bucket: 1-4 parameters of 1-3 dims (sizes 0-9), Shard(0) or even Shard(1)."""
    world_size = draw(st.sampled_from((1, 2, 3, 4, 5, 8)))
    sizes, dims = [], []
    for _ in range(draw(st.integers(1, 4))):
        size = draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))
        dim = draw(st.sampled_from((0, 1))) if len(size) > 1 else 0
        if dim == 1:
            size[1] = world_size * draw(st.integers(0, 3))
        sizes.append(tuple(size))
        dims.append(dim)
    return sizes, dims, world_size


PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


@PROPERTY_SETTINGS
@given(bucket=buckets(), mode=st.sampled_from(MODES), seed=st.integers(0, 2**16))
def test_property_all_gather_round_trip(bucket, mode, seed) -> None:
    sizes, dims, world_size = bucket
    check_all_gather_round_trip(sizes, dims, world_size, mode, seed)


@PROPERTY_SETTINGS
@given(
    bucket=buckets(),
    dtypes=st.sampled_from([(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                            (torch.float16, torch.float16), (torch.float32, torch.bfloat16)]),
    predivide=st.sampled_from((None, 2.0, 3.0)),
    postdivide=st.sampled_from((None, 1.5, 4.0)),
)
def test_property_reduce_scatter_ops(bucket, dtypes, predivide, postdivide) -> None:
    sizes, dims, world_size = bucket
    grad_dtype, reduce_dtype = dtypes
    check_reduce_scatter_copy_in(sizes, dims, world_size, grad_dtype, reduce_dtype, predivide)
    for rank in range(world_size):
        check_view_out(sizes, dims, world_size, rank, reduce_dtype, grad_dtype, postdivide)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(bucket=buckets(), mode=st.sampled_from(MODES), data=st.data())
def test_property_opcheck(bucket, mode, data) -> None:
    sizes, dims, world_size = bucket
    rank = data.draw(st.integers(0, world_size - 1))
    copy_in, copy_out = all_gather_args(sizes, dims, world_size, mode, rank)
    torch.library.opcheck(ops.all_gather_copy_in, copy_in)
    torch.library.opcheck(ops.all_gather_copy_out, copy_out)
    _, _, ag_dtype = mode_dtypes(mode, len(sizes))
    reduce_dtype = torch.float32 if ag_dtype == torch.uint8 else ag_dtype
    rs_in, view_out = reduce_args(
        sizes, dims, world_size, reduce_dtype, reduce_dtype, 2.0, rank, 2.0
    )
    torch.library.opcheck(ops.reduce_scatter_copy_in, rs_in)
    torch.library.opcheck(ops.reduce_scatter_view_out, view_out)
