"""The fp16 reduce-scatter copy-in with a pre-divide, compiled against eager, bit for bit.

Eager (as FSDP2) casts the gradients to the reduce dtype, rounding, then divides,
rounding again. Inductor fuses the two and by default keeps the intermediate in fp32,
which differs from eager where the cast overflows to inf or the quotient is subnormal
(the pre-divide factor is a power of two, see ``gradient_divide_schedule``, so nowhere
else). ``inductor_options()`` turns on Inductor's precision-cast emulation, and the
compiled copy is then eager's, bit for bit. A multiply by the reciprocal, which is what
Inductor emits for a division by a constant on GPU (and torch's CUDA kernels run
eagerly), is the same arithmetic for a power of two.
"""

from __future__ import annotations

import pytest
import torch

import fsdp_traceable
from fsdp_traceable.collectives.divide_factors import gradient_divide_schedule

F16, F32 = torch.float16, torch.float32
WORLD = 4
FP16_MAX_ROUNDED = 65520.0  # the smallest fp32 magnitude that rounds to fp16 inf
FP16_MIN_NORMAL = 2.0**-14


def _grads() -> list[torch.Tensor]:
    """fp32 gradients spanning fp16's range: ordinary values, values that overflow in
    fp16 but not after the divide, and values whose quotient is subnormal."""
    torch.manual_seed(0)
    ordinary = torch.randn(64, 33) * 100
    overflowing = torch.linspace(60000.0, 200000.0, 96).view(12, 8)
    tiny = torch.randn(40, 5) * 1e-5
    return [ordinary, overflowing, tiny]


def _copy_in(grads: list[torch.Tensor], factor: float) -> torch.Tensor:
    return torch.ops.fsdp_traceable.reduce_scatter_copy_in(grads, WORLD, [0, 0, 0], F16, factor)


@pytest.fixture
def predivide_factor() -> float:
    schedule = gradient_divide_schedule(WORLD * 4, 1, F16)  # 16 ranks of fp16
    assert schedule.predivide_factor == 4.0
    return schedule.predivide_factor


@pytest.mark.slow
def test_compiled_with_inductor_options_is_eager_bit_for_bit(predivide_factor, inductor_cache):
    grads = _grads()
    eager = _copy_in(grads, predivide_factor)
    options = fsdp_traceable.inductor_options()
    compiled = torch.compile(_copy_in, fullgraph=True, options=options)(grads, predivide_factor)
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))
    # The data reach both edges: eager overflowed some elements and made some subnormal.
    assert eager.isinf().any() and (eager.abs() < FP16_MIN_NORMAL).logical_and(eager != 0).any()


@pytest.mark.slow
def test_inductor_defaults_differ_only_at_the_stated_edges(predivide_factor, inductor_cache):
    grads = _grads()
    eager = _copy_in(grads, predivide_factor)
    compiled = torch.compile(_copy_in, fullgraph=True)(grads, predivide_factor)
    # The same layout unrounded and undivided: where eager's cast overflowed.
    reference = torch.ops.fsdp_traceable.reduce_scatter_copy_in(grads, WORLD, [0, 0, 0], F32, None)
    differs = compiled.view(torch.int16) != eager.view(torch.int16)
    edge = (reference.abs() >= FP16_MAX_ROUNDED) | (eager.abs() < FP16_MIN_NORMAL)
    assert differs.any(), "the defaults now round like eager: inductor_options' exact_casts is moot"
    assert not (differs & ~edge).any()


def test_reciprocal_multiply_is_the_divide_for_power_of_two_factors(predivide_factor):
    rounded = torch.cat([g.reshape(-1) for g in _grads()]).to(F16)
    divided = rounded.div(predivide_factor)
    multiplied = rounded.mul(1.0 / predivide_factor)
    assert torch.equal(divided.view(torch.int16), multiplied.view(torch.int16))
