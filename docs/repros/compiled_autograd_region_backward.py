"""Compiled autograd cannot compile a ``nested_compile_region``'s backward (torch 2.11 to
2.15).

A region called twice under ``torch.compile``: compiled autograd pastes each call's AOT
backward into its graph as ``invoke_subgraph`` calls, which its Dynamo pass refuses to
trace (``Unsupported``). Compiled autograd has no hook to keep a repeated block's
backward as one region; fsdp_traceable wraps its ``extract_bw_module`` to outline such
backwards itself (``_torch_patches.rewrite_aot_backwards``). No fsdp_traceable code is
involved.

Run: python docs/repros/compiled_autograd_region_backward.py
Prints "Unsupported: ..." while torch has the problem, "compiled" once fixed.
"""

import torch


@torch.compiler.nested_compile_region
def region(x, w):
    return torch.sin(x @ w)


def twice(x, w):
    return region(region(x, w), w).sum()


x = torch.randn(4, 4, requires_grad=True)
w = torch.randn(4, 4, requires_grad=True)
loss = torch.compile(twice, backend="aot_eager", fullgraph=True)(x, w)
try:
    with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
        loss.backward()
    print("compiled")
except torch._dynamo.exc.Unsupported as error:
    print("Unsupported:", str(error).splitlines()[0])
