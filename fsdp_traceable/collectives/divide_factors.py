"""Gradient divide factors and reduce ops, with FSDP2's numerics."""

from __future__ import annotations

from typing import NamedTuple

import torch

# reduce ops every backend FSDP runs on (gloo, NCCL) implements for reduce-scatter
# and all-reduce, as functional-collective names.
SUPPORTED_REDUCE_OPS = ("sum", "avg")


class ReduceSchedule(NamedTuple):
    """How a gradient bucket is averaged across data-parallel ranks."""

    predivide_factor: float | None
    postdivide_factor: float | None
    reduce_scatter_op: str
    all_reduce_op: str


def gradient_divide_schedule(
    reduce_scatter_size: int,
    all_reduce_size: int,
    reduce_dtype: torch.dtype,
    gradient_divide_factor: float | None = None,
    force_sum_reduction: bool = False,
) -> ReduceSchedule:
    """Chooses pre/post divide factors and reduce ops for one reduction.

    Mirrors FSDP2: fp32/bf16 average with the collective's built-in ``avg``; fp16
    (overflow risk) sums and divides by about ``sqrt(N)`` before and ``N / pre``
    after, the pre-factor being the largest power of two that divides ``N`` with
    ``pre < N / pre``. A custom ``gradient_divide_factor`` other than the
    reduce-scatter size is applied as a post-divide with ``sum`` (FSDP2 uses NCCL's
    ``premul_sum`` there, which gloo and functional collectives lack).

    Args:
        reduce_scatter_size: ranks in the shard group.
        all_reduce_size: ranks in the replicate group (1 without HSDP).
        reduce_dtype: dtype the gradients are reduced in.
        gradient_divide_factor: divide by this instead of the data-parallel size.
        force_sum_reduction: use ``sum`` and explicit divides even where ``avg`` works.

    Returns:
        The :class:`ReduceSchedule`.
    """
    if gradient_divide_factor is not None and not gradient_divide_factor > 0:
        raise ValueError(
            f"gradient_divide_factor must be a positive number, got {gradient_divide_factor!r}"
        )
    data_parallel_size = reduce_scatter_size * all_reduce_size
    overflow_risk = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow_risk and not force_sum_reduction:
        if gradient_divide_factor is None:
            op = "sum" if data_parallel_size == 1 else "avg"
            return ReduceSchedule(None, None, op, op)
        if gradient_divide_factor == reduce_scatter_size:
            return ReduceSchedule(None, None, "avg", "sum")
        return ReduceSchedule(None, float(gradient_divide_factor), "sum", "sum")

    factor = float(gradient_divide_factor or data_parallel_size)
    if overflow_risk:
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return ReduceSchedule(float(pre), factor / pre, "sum", "sum")
    return ReduceSchedule(None, factor, "sum", "sum")
