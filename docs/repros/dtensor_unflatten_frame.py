"""Dynamo cannot trace ``DTensor.__tensor_unflatten__`` (torch 2.11 to 2.15).

AOTAutograd's runtime rewraps a compiled backward's DTensor gradients with
``DTensor.__tensor_unflatten__``; where that runs under Dynamo (a compiled-autograd
backward), Dynamo compiles it as a frame of its own and graph-breaks on the raw DTensor
constructor. Compiled with ``fullgraph=True`` here: ``Unsupported``.
fsdp_traceable skips that function as a top-level frame
(``_torch_patches.skip_dtensor_unflatten_frames``). No fsdp_traceable code is involved.

Run: python docs/repros/dtensor_unflatten_frame.py
Prints "Unsupported: ..." while torch has the problem, "traced" once fixed.
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))
dtensor = DTensor.from_local(torch.randn(4, 4), mesh, [Shard(0)], run_check=False)
names, spec = dtensor.__tensor_flatten__()
inner = {name: getattr(dtensor, name) for name in names}


def unflatten(inner: dict) -> DTensor:
    return DTensor.__tensor_unflatten__(inner, spec, dtensor.size(), dtensor.stride())


try:
    torch.compile(unflatten, backend="eager", fullgraph=True)(inner)
    print("traced")
except torch._dynamo.exc.Unsupported as error:
    print("Unsupported:", str(error).splitlines()[0])
dist.destroy_process_group()
