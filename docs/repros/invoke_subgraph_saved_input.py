"""torch.compiler.nested_compile_region under Inductor: gradients wrong when a region's
partitioned forward returns one of its own inputs for the backward (torch 2.13).

The partitioner of a region (AOTAutograd's ``run_joint_graph_passes_on_hops``) makes the
region's forward return what its backward saves, its own inputs included (here the
LayerNorm input). Inductor lowers every output of an ``invoke_subgraph`` call as a buffer
of its own, frees the input's buffer after the call and reuses it before the backward
reads the "saved" value. ``aot_eager`` reuses no buffer and is exact. No fsdp_traceable
code is involved; fsdp_traceable's whole step works around it
(``region_schedule.read_passed_through_inputs_outside_regions``).

Run: python docs/repros/invoke_subgraph_saved_input.py
Prints the largest gradient difference from eager per backend (torch 2.13.0:
aot_eager 0.0, inductor about 0.1).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.w = nn.Linear(dim, dim)


blocks = nn.ModuleList(Block() for _ in range(3))
mats = [torch.randn(16, 16, requires_grad=True) for _ in range(3)]


@torch.compiler.nested_compile_region
def region(x, norm_weight, norm_bias, weight, bias):
    return F.linear(F.layer_norm(x, (16,), norm_weight, norm_bias), weight, bias)


def model(x: torch.Tensor) -> torch.Tensor:
    for i, block in enumerate(blocks):
        x = x @ mats[i]  # an op outside: the region's input is a buffer of the outer graph
        x = region(x, block.norm.weight, block.norm.bias, block.w.weight, block.w.bias)
        x = x + 1
    return x.pow(2).mean()


def grads(fn) -> list[torch.Tensor]:
    for param in blocks.parameters():
        param.grad = None
    x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(1))
    fn(x).backward()
    return [param.grad.clone() for param in blocks.parameters()]


reference = grads(model)
for backend in ("aot_eager", "inductor"):
    torch._dynamo.reset()
    got = grads(torch.compile(model, backend=backend, fullgraph=True))
    print(backend, max((a - b).abs().max().item() for a, b in zip(reference, got)))
