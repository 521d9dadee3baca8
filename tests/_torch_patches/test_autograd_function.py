"""The patch of ``fsdp_traceable/_torch_patches/autograd_function.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pytest
import torch

from fsdp_traceable import _torch_patches

# -- Dynamo compares every output of a Function's forward with every input ------------

class _Doubled(torch.autograd.Function):
    """Each input times two: outputs that are never inputs."""

    @staticmethod
    @_torch_patches.fresh_outputs
    def forward(ctx: object, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t * 2 for t in inputs)

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(g * 2 for g in grads)


def _forward_helper_bytecodes(count: int, helper: object | None) -> int:
    """Bytecodes Dynamo traces inside torch's forward helper (``torch/_functorch/
    autograd_function.py``) for one call of :class:`_Doubled` on ``count`` tensors,
    with ``helper`` in place of the installed one (``None``: the installed one); checks
    the compiled outputs and gradients against eager."""
    from torch._dynamo import symbolic_convert
    from torch._functorch.autograd_function import DynamoAutogradFunctionTraceHelper

    traced = [0]
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self: symbolic_convert.InstructionTranslatorBase) -> object:
        # (torch's file only: this test file's name ends the same way)
        if self.f_code.co_filename.replace("\\", "/").endswith("_functorch/autograd_function.py"):
            traced[0] += 1
        return step(self)

    def fn(*inputs: torch.Tensor) -> torch.Tensor:
        return sum(out.sum() for out in _Doubled.apply(*inputs))

    inputs = [torch.randn(3, requires_grad=True) for _ in range(count)]
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symbolic_convert.InstructionTranslatorBase, "step", counted)
        if helper is not None:
            patch.setattr(DynamoAutogradFunctionTraceHelper, "fwd_trace_helper", helper)
        loss = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
    loss.backward()
    assert loss.item() == pytest.approx(2 * sum(t.sum().item() for t in inputs), rel=1e-6, abs=1e-6)
    assert all(torch.equal(t.grad, torch.full((3,), 2.0)) for t in inputs)
    return traced[0]


needs_forward_helper = pytest.mark.skipif(
    not _torch_patches.trust_fresh_outputs(), reason="this torch has no traced forward helper")


@needs_forward_helper
def test_torch_still_compares_every_output_with_every_input() -> None:
    from torch._functorch.autograd_function import DynamoAutogradFunctionTraceHelper

    unpatched = DynamoAutogradFunctionTraceHelper.fwd_trace_helper.__wrapped__
    small, large = (_forward_helper_bytecodes(n, unpatched) for n in (4, 8))
    # At least 25 more per tensor (32 on torch 2.11's set lookups; 2.13's pairwise
    # comparisons: 547 and 1531 for 4 and 8 tensors).
    assert large - small >= 4 * 25


@needs_forward_helper
def test_fresh_outputs_skip_the_comparisons_and_keep_the_numbers() -> None:
    assert _torch_patches.trust_fresh_outputs()  # again: no change
    assert _forward_helper_bytecodes(8, None) == _forward_helper_bytecodes(4, None) < 50
