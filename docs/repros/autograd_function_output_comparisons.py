"""Dynamo traces an ``autograd.Function``'s forward outputs against every input
(torch 2.12 to 2.15).

Dynamo runs every traced ``autograd.Function.forward`` through a Python copy of
autograd's C++ output handling (``torch/_functorch/autograd_function.py``), which since
2.12 compares every output with every input to find aliases: ``O(outputs x inputs)``
traced bytecodes, for a Function whose outputs are never its inputs too (a parameter
group's all-gather: about 2,500 bytecodes per 9-parameter group). fsdp_traceable marks
its own such forward and skips the comparisons for it
(``_torch_patches.trust_fresh_outputs``). No fsdp_traceable code is involved.

Run: python docs/repros/autograd_function_output_comparisons.py
Prints the bytecodes Dynamo traced in that helper per input count (torch 2.13: about
550 for 4 tensors, 1,500 for 8: growing with the square).
"""

import torch
from torch._dynamo import symbolic_convert


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, *inputs):
        return tuple(t * 2 for t in inputs)

    @staticmethod
    def backward(ctx, *grads):
        return tuple(g * 2 for g in grads)


traced = [0]
step = symbolic_convert.InstructionTranslatorBase.step


def counted(self):
    if self.f_code.co_filename.endswith("autograd_function.py"):
        traced[0] += 1
    return step(self)


symbolic_convert.InstructionTranslatorBase.step = counted
for count in (4, 8, 16):
    traced[0] = 0
    torch._dynamo.reset()
    inputs = [torch.randn(3, requires_grad=True) for _ in range(count)]
    torch.compile(lambda *xs: sum(o.sum() for o in Doubled.apply(*xs)),
                  backend="aot_eager", fullgraph=True)(*inputs)
    print(f"{count} inputs: {traced[0]} bytecodes traced in the output handling")
