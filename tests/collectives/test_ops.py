"""The four torch.ops.fsdp_traceable copy ops against FSDP2-style reference math.

Ranks are simulated by slicing one full tensor per parameter: rank r holds
torch.chunk(full, world)[r] (empty past the last chunk), padded along the shard dim
to ceil(size / world) rows. An all-gather is then the concatenation of every rank's
copy-in, and a sum reduce-scatter is the sum over ranks of their copy-in rows.
"""

from __future__ import annotations

import pytest
import torch
from torch._prims_common import make_contiguous_strides_for

from fsdp_traceable import ShardInfo, make_shard_info, shard_tensor

ops = torch.ops.fsdp_traceable

WORLD_SIZES = (1, 2, 3, 4, 8)
# Prime dim-0 sizes, numel < world, empty parameters and a one-element one.
DIM0_SIZES = [(7, 3), (13,), (2, 5), (1,), (0, 4), (3,), (4, 0), (11, 2, 3)]
MODES = ("fp32", "bf16", "fp16", "mixed")


def shard1_bucket(world_size: int) -> tuple[list[tuple[int, ...]], list[int]]:
    """A bucket mixing Shard(1) (dim 1 divisible by the world) and uneven Shard(0)."""
    sizes = [(3, 2 * world_size), (5,), (1, world_size, 2), (2, 0), (0, world_size), (9, 2)]
    return sizes, [1, 0, 1, 1, 1, 0]


def mode_dtypes(mode: str, n: int) -> tuple[list[torch.dtype], list[torch.dtype], torch.dtype]:
    """(orig dtypes, param dtypes, all-gather dtype) of an ``n``-parameter bucket."""
    if mode == "fp32":
        return [torch.float32] * n, [torch.float32] * n, torch.float32
    if mode == "bf16":  # fp32 parameters gathered in bf16 (mixed precision cast in copy-in)
        return [torch.float32] * n, [torch.bfloat16] * n, torch.bfloat16
    if mode == "fp16":
        return [torch.float16] * n, [torch.float16] * n, torch.float16
    cycle = (torch.float32, torch.bfloat16, torch.float16)
    dtypes = [cycle[i % 3] for i in range(n)]
    return dtypes, dtypes, torch.uint8


def make_fulls(sizes, dtypes, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(size, generator=gen).to(dtype) for size, dtype in zip(sizes, dtypes)]


def ref_rank_chunk(full: torch.Tensor, world_size: int, rank: int, dim: int) -> torch.Tensor:
    """Rank ``rank``'s chunk padded with zeros to ceil(size(dim) / world) along ``dim``."""
    chunks = torch.chunk(full, world_size, dim=dim)
    rows = -(-full.size(dim) // world_size)
    padded = full.new_zeros(full.shape[:dim] + (rows,) + full.shape[dim + 1 :])
    if rank < len(chunks) and chunks[rank].numel() > 0:
        padded.narrow(dim, 0, chunks[rank].size(dim)).copy_(chunks[rank])
    return padded


def ref_all_gather_input(fulls, world_size, rank, dims, param_dtypes, ag_dtype) -> torch.Tensor:
    pieces = []
    for full, dim, dtype in zip(fulls, dims, param_dtypes):
        flat = ref_rank_chunk(full.to(dtype), world_size, rank, dim).reshape(-1)
        pieces.append(flat.view(torch.uint8) if ag_dtype == torch.uint8 else flat)
    return torch.cat(pieces)


def ref_reduce_scatter_rows(grads, world_size, dims, reduce_dtype, predivide) -> torch.Tensor:
    """Row r: rank r's padded chunk of every gradient, cast, then pre-divided."""
    rows = []
    for rank in range(world_size):
        row = torch.cat([
            ref_rank_chunk(g.to(reduce_dtype), world_size, rank, d).reshape(-1)
            for g, d in zip(grads, dims)
        ])
        rows.append(row if predivide is None else row.div(predivide))
    return torch.stack(rows)


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    as_bytes = [t.contiguous().reshape(-1).view(torch.uint8) for t in (actual, expected)]
    assert torch.equal(*as_bytes)


def assert_contiguous_strides(t: torch.Tensor, stride: tuple[int, ...]) -> None:
    # An empty tensor's strides carry no layout (aten may pick 0 for a size-1 dim).
    if t.numel() == 0:
        assert t.is_contiguous()
    else:
        assert t.stride() == tuple(stride)


def assert_fresh(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> None:
    """No output shares storage with an input or with another output."""
    ptrs = [t.untyped_storage().data_ptr() for t in outputs if t.untyped_storage().nbytes() > 0]
    assert len(ptrs) == len(set(ptrs)), "outputs alias each other"
    in_ptrs = {t.untyped_storage().data_ptr() for t in inputs if t.untyped_storage().nbytes() > 0}
    assert not in_ptrs & set(ptrs), "an output aliases an input"


def bucket_infos(sizes, dims, world_size, rank, orig_dtypes, param_dtypes) -> list[ShardInfo]:
    return [
        make_shard_info(s, world_size, rank, shard_dim=d, orig_dtype=o, param_dtype=p)
        for s, d, o, p in zip(sizes, dims, orig_dtypes, param_dtypes)
    ]


def copy_out_args(infos: list[ShardInfo]) -> tuple:
    sizes_flat = [s for i in infos for s in i.global_size]
    return (infos[0].world_size, sizes_flat, [len(i.global_size) for i in infos],
            [i.shard_dim for i in infos], [i.param_dtype for i in infos])


def check_all_gather_round_trip(sizes, dims, world_size, mode, seed=0) -> None:
    orig_dtypes, param_dtypes, ag_dtype = mode_dtypes(mode, len(sizes))
    fulls = make_fulls(sizes, orig_dtypes, seed)
    inputs = []
    for rank in range(world_size):
        infos = bucket_infos(sizes, dims, world_size, rank, orig_dtypes, param_dtypes)
        shards = [shard_tensor(full, info) for full, info in zip(fulls, infos)]
        flat = ops.all_gather_copy_in(shards, [i.padded_sharded_numel for i in infos], ag_dtype)
        expected = ref_all_gather_input(fulls, world_size, rank, dims, param_dtypes, ag_dtype)
        assert_bitwise_equal(flat, expected)
        assert_fresh([flat], shards)
        inputs.append(flat)
    all_gather_output = torch.cat(inputs)
    outs = ops.all_gather_copy_out(all_gather_output, *copy_out_args(infos))
    assert len(outs) == len(fulls)
    for out, full, dtype in zip(outs, fulls, param_dtypes):
        assert_bitwise_equal(out, full.to(dtype))
        assert_contiguous_strides(out, make_contiguous_strides_for(out.shape))
    assert_fresh(outs, [all_gather_output])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_round_trip_dim0(world_size: int, mode: str) -> None:
    check_all_gather_round_trip(DIM0_SIZES, [0] * len(DIM0_SIZES), world_size, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_all_gather_round_trip_shard1(world_size: int, mode: str) -> None:
    sizes, dims = shard1_bucket(world_size)
    check_all_gather_round_trip(sizes, dims, world_size, mode)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("size", [(5, 3), (1,), (0, 2), (3, 2 * 8)])
def test_all_gather_single_parameter_outputs_are_fresh(world_size: int, size) -> None:
    # One parameter (or one rank) makes the gathered chunk contiguous: the output
    # must still be a copy, never a view of the all-gather buffer.
    for dim in (0, 1) if len(size) > 1 and size[1] % world_size == 0 else (0,):
        check_all_gather_round_trip([size], [dim], world_size, "fp32")


def test_all_gather_copy_in_accepts_non_contiguous_shards() -> None:
    full = torch.randn(6, 4)
    shard = full.t()  # (4, 6), not contiguous
    flat = ops.all_gather_copy_in([shard], [30], torch.float32)
    assert_bitwise_equal(flat[:24], shard.contiguous().view(-1))
    assert torch.count_nonzero(flat[24:]) == 0


REDUCE_CASES = [  # (grad dtype, reduce dtype, predivide)
    (torch.float32, torch.float32, None),
    (torch.bfloat16, torch.float32, None),
    (torch.float32, torch.bfloat16, 4.0),
    (torch.bfloat16, torch.bfloat16, 3.0),
    (torch.float16, torch.float16, 2.0),
    (torch.float16, torch.float32, 1.5),
]


def reduce_buckets(world_size: int):
    yield DIM0_SIZES, [0] * len(DIM0_SIZES)
    yield shard1_bucket(world_size)


def check_reduce_scatter_copy_in(sizes, dims, world_size, grad_dtype, reduce_dtype, predivide):
    grads = make_fulls(sizes, [grad_dtype] * len(sizes), seed=world_size)
    out = ops.reduce_scatter_copy_in(grads, world_size, dims, reduce_dtype, predivide)
    per_rank = sum(
        make_shard_info(s, world_size, 0, shard_dim=d).padded_sharded_numel
        for s, d in zip(sizes, dims)
    )
    assert out.shape == (world_size * per_rank,) and out.dtype == reduce_dtype
    expected = ref_reduce_scatter_rows(grads, world_size, dims, reduce_dtype, predivide)
    for rank in range(world_size):
        assert_bitwise_equal(out.view(world_size, per_rank)[rank], expected[rank])
    assert_fresh([out], grads)


@pytest.mark.parametrize("grad_dtype, reduce_dtype, predivide", REDUCE_CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_copy_in_layout(world_size, grad_dtype, reduce_dtype, predivide) -> None:
    for sizes, dims in reduce_buckets(world_size):
        check_reduce_scatter_copy_in(sizes, dims, world_size, grad_dtype, reduce_dtype, predivide)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_copy_in_single_and_empty(world_size: int) -> None:
    for sizes, dims in [([(6,)], [0]), ([(0, 3)], [0]), ([(0,), (2, 0)], [0, 1])]:
        grads = make_fulls(sizes, [torch.float32] * len(sizes))
        out = ops.reduce_scatter_copy_in(grads, world_size, dims, torch.float32, None)
        expected = ref_reduce_scatter_rows(grads, world_size, dims, torch.float32, None)
        assert_bitwise_equal(out, expected.reshape(-1))
        assert_fresh([out], grads)


VIEW_OUT_CASES = [  # (reduce dtype, orig dtype, postdivide)
    (torch.float32, torch.float32, None),
    (torch.float32, torch.float32, 2.0),
    (torch.bfloat16, torch.float32, 2.0),
    (torch.float16, torch.float16, 1.5),
    (torch.float32, torch.bfloat16, None),
    (torch.bfloat16, torch.bfloat16, None),
]


def check_view_out(sizes, dims, world_size, rank, reduce_dtype, orig_dtype, postdivide) -> None:
    infos = [make_shard_info(s, world_size, rank, shard_dim=d) for s, d in zip(sizes, dims)]
    padded = [i.padded_sharded_numel for i in infos]
    reduce_output = torch.randn(sum(padded)).to(reduce_dtype)
    outs = ops.reduce_scatter_view_out(
        reduce_output, [s for i in infos for s in i.sharded_size],
        [len(i.sharded_size) for i in infos], padded, orig_dtype, postdivide,
    )
    assert len(outs) == len(infos)
    start = 0
    for out, info, numel in zip(outs, infos, padded):
        piece = reduce_output[start : start + info.sharded_numel]
        if postdivide is not None:
            piece = piece / postdivide
        assert_bitwise_equal(out, piece.to(orig_dtype).view(info.sharded_size))
        assert_contiguous_strides(out, info.contiguous_sharded_stride)
        start += numel
    assert_fresh(outs, [reduce_output])


@pytest.mark.parametrize("reduce_dtype, orig_dtype, postdivide", VIEW_OUT_CASES)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_reduce_scatter_view_out(world_size, reduce_dtype, orig_dtype, postdivide) -> None:
    for sizes, dims in reduce_buckets(world_size):
        for rank in range(world_size):
            check_view_out(sizes, dims, world_size, rank, reduce_dtype, orig_dtype, postdivide)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("orig_dtype, reduce_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.float16, torch.float16),
])
def test_simulated_reduce_scatter_gives_fsdp2_sharded_grads(world_size, orig_dtype, reduce_dtype):
    # Integer-valued gradients keep every sum exact, so the simulated reduce-scatter
    # (sum over ranks of each rank's copy-in row) must match chunking the summed gradient.
    sizes, dims = shard1_bucket(world_size)
    gen = torch.Generator().manual_seed(world_size)
    per_rank_grads = [
        [torch.randint(-4, 5, s, generator=gen).to(orig_dtype) for s in sizes]
        for _ in range(world_size)
    ]
    predivide, postdivide = (2.0, world_size / 2) if world_size % 2 == 0 else (None, world_size)
    rows = torch.stack([
        ops.reduce_scatter_copy_in(g, world_size, dims, reduce_dtype, predivide)
        for g in per_rank_grads
    ]).view(world_size, world_size, -1)
    summed = [sum(g[i].to(torch.float64) for g in per_rank_grads) for i in range(len(sizes))]
    for rank in range(world_size):
        reduce_output = rows[:, rank].sum(0)  # what a "sum" reduce-scatter gives rank r
        infos = [make_shard_info(s, world_size, rank, shard_dim=d) for s, d in zip(sizes, dims)]
        outs = ops.reduce_scatter_view_out(
            reduce_output, [s for i in infos for s in i.sharded_size],
            [len(i.sharded_size) for i in infos], [i.padded_sharded_numel for i in infos],
            orig_dtype, postdivide,
        )
        for out, full, info in zip(outs, summed, infos):
            expected = shard_tensor(full, info).to(reduce_dtype) / world_size
            assert out.shape == info.sharded_size
            torch.testing.assert_close(out, expected.to(orig_dtype), rtol=0, atol=0)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("mode", ["fp32", "bf16"])
@pytest.mark.parametrize("world_size", (1, 3, 4))
@pytest.mark.usefixtures("inductor_cache")
def test_compiled_copy_out_is_the_eager_copy_out(world_size, mode, backend) -> None:
    # Compiled, a one-dtype Shard(0) bucket is copied out by one cat into one buffer
    # (the parameters are views of it); eager by split_with_sizes_copy. Same bits,
    # -0.0, NaN payloads and infinities included, and same shapes and strides.
    orig_dtypes, param_dtypes, ag_dtype = mode_dtypes(mode, len(DIM0_SIZES))
    infos = bucket_infos(DIM0_SIZES, [0] * len(DIM0_SIZES), world_size, 0, orig_dtypes, param_dtypes)
    numel = world_size * sum(i.padded_sharded_numel for i in infos)
    gathered = torch.randn(numel).to(ag_dtype)
    specials = torch.tensor([-0.0, float("nan"), float("inf"), -float("inf")]).to(ag_dtype)
    gathered[: min(numel, 4)] = specials[: min(numel, 4)]
    if numel > 4:  # a NaN with a payload
        bits, nan_bits = ((torch.int16, 0x7FC1) if ag_dtype == torch.bfloat16
                          else (torch.int32, 0x7FC00001))
        gathered.view(bits)[4] = nan_bits
    args = copy_out_args(infos)
    torch._dynamo.reset()
    compiled = torch.compile(lambda t: ops.all_gather_copy_out(t, *args), backend=backend,
                             fullgraph=True)(gathered)
    eager = ops.all_gather_copy_out(gathered, *args)
    assert len(compiled) == len(eager)
    for got, want in zip(compiled, eager):
        assert_bitwise_equal(got, want)
        assert_contiguous_strides(got, want.stride())
    torch._dynamo.reset()
