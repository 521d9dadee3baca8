"""Dynamo's traced ``backward()`` asserts on DTensor leaves (torch 2.11; 2.12 on take
tensor subclasses).

With ``torch._dynamo.config.trace_autograd_ops`` Dynamo traces ``loss.backward()`` as a
``torch.autograd.grad`` call whose handler asserts every tensor it differentiates is a
plain fake tensor, so a step over a DTensor parameter fails in Dynamo. fsdp_traceable's
``compile_step`` takes a traceable subclass whose inner tensors are fake as it is, as
torch 2.12 does (``_torch_patches.trace_backward_into_subclasses``). No fsdp_traceable
code is involved.

Run: python docs/repros/dtensor_backward_trace.py
Prints the gradient (torch 2.12 on: all 3.0) or the error (torch 2.11: an
AssertionError inside Dynamo).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
weight = torch.nn.Parameter(DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)]))
x = DTensor.from_local(torch.full((4,), 3.0), mesh, [Shard(0)])


def step(x):
    (weight * x).sum().backward()


try:
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
    print("gradient:", weight.grad.to_local().tolist())
except Exception as error:
    cause = error if isinstance(error, AssertionError) else error.__cause__
    print(type(error).__name__, "caused by", type(cause).__name__)
dist.destroy_process_group()
