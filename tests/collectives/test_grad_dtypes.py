"""Why a compiled step still rounds a wider gradient to the compute dtype where FSDP2
2.15's eager keeps it (see [Note: wider gradient dtypes]): torch cannot declare a
traced ``autograd.Function``'s output gradient dtypes. Single process, ``aot_eager``."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from fsdp_traceable.collectives.grad_dtypes import keeps_wider_grads


class _Unshard(torch.autograd.Function):
    """A bf16 copy of an fp32 parameter whose gradient should reach backward uncast,
    as ``UnshardParams`` declares it in eager."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, declare: str) -> torch.Tensor:
        if declare == "method":
            ctx.set_output_grad_dtype(None)
        elif declare == "attribute":  # what the method records, set directly
            ctx.output_grad_dtypes = (None,)
        return weight.to(torch.bfloat16)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.float(), None


def _norm_weight_grad(declare: str, compiled: bool) -> tuple[torch.Tensor, list[str]]:
    """The weight's gradient in ``x.float() * weight`` (a norm weight's use), and the
    dtypes of the casts AOTAutograd's backward graph holds."""
    torch.manual_seed(0)
    weight = torch.randn(64, requires_grad=True)
    x = torch.randn(64, dtype=torch.bfloat16)
    casts: list[str] = []

    def keep_casts(gm: torch.fx.GraphModule, example_inputs: object) -> object:
        casts.extend(str(n.kwargs["dtype"]) for n in gm.graph.nodes
                     if n.target is torch.ops.aten._to_copy.default)
        return make_boxed_func(gm)

    def loss(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return (x.float() * _Unshard.apply(weight, declare) * 1.001).sum()

    if compiled:
        backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm),
                               bw_compiler=keep_casts)
        loss = torch.compile(loss, backend=backend, fullgraph=True)
    loss(weight, x).backward()
    return weight.grad, casts


@pytest.mark.skipif(not keeps_wider_grads(), reason="this torch's FSDP2 rounds such gradients too")
def test_torch_still_cannot_declare_gradient_dtypes_in_a_traced_function() -> None:
    # Eager, the declared dtype keeps the fp32 gradient; compiled, Dynamo refuses the
    # method, and the attribute it records is dropped: the backward graph casts the
    # gradient to bf16 and back. Once this fails, the traced UnshardParams can declare
    # its wider outputs' gradient dtypes as the eager one does (grad_dtypes.output_grad_dtypes).
    eager, _ = _norm_weight_grad("method", compiled=False)
    rounded, _ = _norm_weight_grad("none", compiled=False)
    assert not torch.equal(eager, rounded)  # the rounding is real at this size
    torch._dynamo.reset()
    with pytest.raises(Exception, match="output_grad_dtypes"):
        _norm_weight_grad("method", compiled=True)
    torch._dynamo.reset()
    compiled, casts = _norm_weight_grad("attribute", compiled=True)
    assert casts == ["torch.bfloat16", "torch.float32"]
    assert torch.equal(compiled, rounded)
