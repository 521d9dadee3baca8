"""gradient_divide_schedule against FSDP2's own _get_gradient_divide_factors."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
    _get_gradient_divide_factors,
)

from fsdp_traceable import ReduceSchedule, gradient_divide_schedule

REDUCE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
HSDP_SIZES = ((2, 2), (4, 2), (2, 4), (1, 4), (3, 2), (8, 2), (3, 5), (16, 1))


class FakeGroup:
    """The only part of a ProcessGroup that FSDP2's divide-factor logic reads."""

    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


def is_premul_sum(op: object) -> bool:
    return op == dist.ReduceOp.PREMUL_SUM and hasattr(op, "factor")


def op_name(op: object) -> str:
    names = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}
    return names[op]


def fsdp2_schedule(
    reduce_scatter_size: int,
    all_reduce_size: int | None,
    reduce_dtype: torch.dtype,
    factor: float | None = None,
    force_sum: bool = False,
) -> tuple:
    """FSDP2's (pre, post, reduce-scatter op, all-reduce op); all_reduce_size None = no HSDP."""
    all_reduce_group = None if all_reduce_size is None else FakeGroup(all_reduce_size)
    return _get_gradient_divide_factors(
        FakeGroup(reduce_scatter_size), all_reduce_group, reduce_dtype, "cpu", factor, force_sum
    )


def expected_schedule(fsdp2: tuple) -> ReduceSchedule:
    """FSDP2's answer in our terms, with the documented deviation: premul_sum(1/f)
    becomes a post-divide by f with "sum" (gloo and functional collectives lack premul_sum)."""
    pre, post, rs_op, ar_op = fsdp2
    if is_premul_sum(rs_op):
        assert pre is None and post is None
        return ReduceSchedule(None, 1.0 / rs_op.factor, "sum", op_name(ar_op))
    return ReduceSchedule(pre, post, op_name(rs_op), op_name(ar_op))


def assert_same_schedule(ours: ReduceSchedule, want: ReduceSchedule) -> None:
    assert ours.reduce_scatter_op == want.reduce_scatter_op
    assert ours.all_reduce_op == want.all_reduce_op
    for got, exp in ((ours.predivide_factor, want.predivide_factor),
                     (ours.postdivide_factor, want.postdivide_factor)):
        if exp is None:
            assert got is None
        else:
            assert got == pytest.approx(exp, rel=1e-12)


@pytest.mark.parametrize("reduce_dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("force_sum", (False, True))
def test_fsdp_world_sizes(reduce_dtype: torch.dtype, force_sum: bool) -> None:
    for world_size in range(1, 17):
        ours = gradient_divide_schedule(world_size, 1, reduce_dtype, force_sum_reduction=force_sum)
        fsdp2 = fsdp2_schedule(world_size, None, reduce_dtype, force_sum=force_sum)
        assert_same_schedule(ours, expected_schedule(fsdp2))


@pytest.mark.parametrize("reduce_dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("force_sum", (False, True))
def test_hsdp_sizes(reduce_dtype: torch.dtype, force_sum: bool) -> None:
    for rs_size, ar_size in HSDP_SIZES:
        ours = gradient_divide_schedule(
            rs_size, ar_size, reduce_dtype, force_sum_reduction=force_sum
        )
        fsdp2 = fsdp2_schedule(rs_size, ar_size, reduce_dtype, force_sum=force_sum)
        assert_same_schedule(ours, expected_schedule(fsdp2))


@pytest.mark.parametrize("reduce_dtype", REDUCE_DTYPES)
@pytest.mark.parametrize("force_sum", (False, True))
def test_explicit_factors(reduce_dtype: torch.dtype, force_sum: bool) -> None:
    sizes = [(w, None) for w in (1, 2, 3, 4, 8, 16)] + list(HSDP_SIZES)
    for rs_size, ar_size in sizes:
        for factor in (1, 2, 3.0, 4, 6, 7.5, 12, 32, float(rs_size), rs_size * (ar_size or 1)):
            ours = gradient_divide_schedule(
                rs_size, ar_size or 1, reduce_dtype, factor, force_sum_reduction=force_sum
            )
            fsdp2 = fsdp2_schedule(rs_size, ar_size, reduce_dtype, factor, force_sum)
            assert_same_schedule(ours, expected_schedule(fsdp2))


def test_fp16_pre_and_post_factors_multiply_to_world() -> None:
    # fp16 splits the divide around the sum; a few hand-checked values too.
    for world_size in range(1, 17):
        ours = gradient_divide_schedule(world_size, 1, torch.float16)
        assert ours.predivide_factor * ours.postdivide_factor == pytest.approx(world_size)
        assert ours.reduce_scatter_op == ours.all_reduce_op == "sum"
    assert gradient_divide_schedule(8, 1, torch.float16)[:2] == (4.0, 2.0)
    assert gradient_divide_schedule(16, 1, torch.float16)[:2] == (4.0, 4.0)
    assert gradient_divide_schedule(6, 1, torch.float16)[:2] == (4.0, 1.5)
    assert gradient_divide_schedule(4, 2, torch.float16)[:2] == (4.0, 2.0)


@pytest.mark.parametrize("reduce_dtype", (torch.float32, torch.bfloat16))
@pytest.mark.parametrize(
    "rs_size, ar_size, factor", [(2, 1, 3.0), (4, 1, 2), (4, 2, 8.0), (3, 2, 12)]
)
def test_custom_factor_is_post_divide_where_fsdp2_uses_premul_sum(
    reduce_dtype: torch.dtype, rs_size: int, ar_size: int, factor: float
) -> None:
    # The documented deviation, exactly: FSDP2 folds 1/factor into a premul_sum
    # reduce-scatter; we sum and post-divide by factor.
    pre, post, rs_op, ar_op = fsdp2_schedule(rs_size, ar_size if ar_size > 1 else None,
                                             reduce_dtype, factor)
    assert (pre, post, ar_op) == (None, None, dist.ReduceOp.SUM)
    assert is_premul_sum(rs_op) and rs_op.factor == pytest.approx(1 / factor)
    ours = gradient_divide_schedule(rs_size, ar_size, reduce_dtype, factor)
    assert ours == ReduceSchedule(None, float(factor), "sum", "sum")
    assert isinstance(ours.postdivide_factor, float)

    # Both compute sum(g_i) / factor: simulate the two schedules on per-rank gradients.
    grads = torch.randn(rs_size * ar_size, 6, generator=torch.Generator().manual_seed(0))
    premul = (grads * (1 / factor)).sum(0)
    postdiv = grads.sum(0) / ours.postdivide_factor
    torch.testing.assert_close(postdiv, premul, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("reduce_dtype", (torch.float32, torch.bfloat16))
def test_factor_equal_to_shard_size_keeps_avg(reduce_dtype: torch.dtype) -> None:
    # No deviation there: FSDP2 uses AVG for the reduce-scatter and SUM for the all-reduce.
    want = ReduceSchedule(None, None, "avg", "sum")
    assert gradient_divide_schedule(4, 2, reduce_dtype, 4) == want
    assert fsdp2_schedule(4, 2, reduce_dtype, 4)[2:] == (dist.ReduceOp.AVG, dist.ReduceOp.SUM)


@pytest.mark.parametrize("factor", (0, 0.0, -1, -2.5))
def test_non_positive_factor_is_rejected(factor: float) -> None:
    with pytest.raises(ValueError, match=r"gradient_divide_factor must be a positive number"):
        gradient_divide_schedule(2, 1, torch.float32, factor)
