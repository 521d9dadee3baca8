# torch.compile(aot_eager) of a checkpointed block with SDPA whose module holds a DTensor
# parameter: AOTAutograd saves the DTensor's DeviceMesh for backward and the runtime asserts.
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, distribute_tensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils.checkpoint import checkpoint

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
w = nn.Parameter(distribute_tensor(torch.randn(8, 8), mesh, [Replicate()]))

def block(x, weight):
    q = x @ weight.t()
    q = q.view(2, 4, 2, 4).transpose(1, 2)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

def step(x):
    weight = w.to_local()  # a plain tensor read from the DTensor parameter
    return checkpoint(block, x, weight, use_reentrant=False)

x = torch.randn(2, 4, 8)
loss = torch.compile(step, backend="aot_eager", fullgraph=True)(x)
loss.backward()
print("ok", w.grad is not None)
