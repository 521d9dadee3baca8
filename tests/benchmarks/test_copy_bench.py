"""The copy benchmark's contenders compute the same bytes: our copy-in / copy-out ops
against FSDP2's own ``torch.ops.fsdp`` copy path on the same buckets."""

from __future__ import annotations

import pytest
import torch

from tests.benchmarks.scripts import benchmark_script


@pytest.fixture(scope="module")
def copy_bench():
    with benchmark_script("copy_bench") as module:
        yield module


# Uneven dim 0 (padded shards on the later ranks), vectors, a dim 0 smaller than the
# world, and the first parameters of the benchmark's small-parameter workload.
SHAPES = [(5, 3), (4,), (1, 7), (9,), (6, 2, 2)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ours_and_fsdp2_copies_agree_on_every_rank(copy_bench, world_size, dtype):
    shapes = SHAPES + copy_bench.small_param_shapes(count=8)
    for rank in range(world_size):
        case = copy_bench.make_case(shapes, world_size, dtype, rank=rank)
        copy_bench.check_case(case)  # raises on any byte that differs
        flat_input, unsharded = case.ours()
        assert flat_input.numel() * world_size * flat_input.element_size() == case.copy_out_bytes
        assert [tuple(t.shape) for t in unsharded] == [tuple(s) for s in shapes]


def test_check_case_catches_a_wrong_copy_out(copy_bench):
    case = copy_bench.make_case(SHAPES, 2)
    ours = case.ours

    def corrupted():
        flat_input, unsharded = ours()
        unsharded[0][-1, -1] += 1
        return flat_input, unsharded

    case.ours = corrupted
    with pytest.raises(AssertionError, match="ours copy-out"):
        copy_bench.check_case(case)


def test_transformer_block_shapes_are_a_llama_block(copy_bench):
    shapes = copy_bench.transformer_block_shapes(dim=1024, hidden=2816)
    assert len(shapes) == 9
    assert sum(torch.Size(s).numel() for s in shapes) == 4 * 1024**2 + 3 * 2816 * 1024 + 2 * 1024
