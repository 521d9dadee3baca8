"""A ``nested_compile_region`` call Dynamo reuses by key has outputs without autograd
history, so a ``backward()`` traced in the same graph skips its inputs (torch 2.13 to
2.15).

With ``torch._dynamo.config.trace_autograd_ops`` Dynamo traces ``loss.backward()`` and
finds what to differentiate by walking the fake tensors' autograd history. A region
reused through ``reuse_hash_fn`` is "stamped out": its fake outputs are made with
``torch.empty_strided``, requiring grad but with no history, so the loss reaches
nothing behind the second call: neither call's weight gets a gradient (eager: both
do). fsdp_traceable links the stamped-out outputs of its own regions to their inputs
(``_torch_patches.link_stamped_out_regions``). No fsdp_traceable code is involved.

Run: python docs/repros/region_reuse_autograd_history.py
Prints, per call, whether its weight got a gradient, eager then compiled (torch 2.13:
[True, True] then [False, False]).
"""

import torch


@torch.compiler.nested_compile_region(reuse_hash_fn=lambda x, weight: 0)
def block(x, weight):
    return torch.tanh(x @ weight)


weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]


def step(x):
    for weight in weights:
        x = block(x, weight)
    x.sum().backward()


x = torch.randn(4, 8)
step(x)
print("eager:   ", [w.grad is not None for w in weights])
for w in weights:
    w.grad = None
with torch._dynamo.config.patch(trace_autograd_ops=True):
    torch.compile(step, backend="aot_eager", fullgraph=True)(x)
print("compiled:", [w.grad is not None for w in weights])
