"""DTensor's ``new_empty_strided`` of an unevenly sharded DTensor is ``Replicate``
(torch 2.11; 2.13 on keep the shard).

Compiled autograd accumulates a first gradient with
``grad.new_empty_strided(grad.size(), grad.stride()).copy_(grad)``. On torch 2.11,
DTensor's strategy for factory ops keeps a ``Shard(0)`` placement only where the dim
divides evenly, so an unevenly sharded gradient turns ``Replicate``: one all-gather per
such parameter in the backward, and a replicated ``.grad``. fsdp_traceable keeps the
dim-0 sharding there (``_torch_patches.shard_uneven_new_empty_strided``). No
fsdp_traceable code is involved.

Run: python docs/repros/dtensor_uneven_new_empty_strided.py
Prints the placements of ``new_empty_strided`` of a 29-row tensor sharded over 4 ranks
(torch 2.11: (Replicate(),); 2.13: (Shard(dim=0),)).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
mesh = init_device_mesh("cpu", (4,))
piece = DTensor.from_local(torch.randn(8, 29), mesh, [Shard(0)], run_check=False,
                           shape=torch.Size((29, 29)), stride=(29, 1))
print(piece.new_empty_strided(piece.size(), piece.stride()).placements)
dist.destroy_process_group()
