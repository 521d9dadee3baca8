"""``DeviceMesh`` pickles keep the mesh's process-local hash (torch 2.11 to 2.15).

``DeviceMesh.__getstate__`` keeps ``_hash``, cached by the first ``hash(mesh)``. Python's
hash of the mesh's key differs per process (string hashing is salted), so pickles of the
same mesh differ between processes, and so does every Inductor FX graph cache key that
pickles a mesh (torch 2.13 passes a DTensor parameter's mesh as a graph input): a new
process never finds the graphs the previous one compiled. fsdp_traceable drops the hash
from the pickles of its own meshes (``_torch_patches.drop_mesh_hash_from_pickles``).
No fsdp_traceable code is involved.

Run: python docs/repros/device_mesh_pickled_hash.py
Prints whether the pickled state holds "_hash" and whether the FX graph cache's bytes
for the mesh differ when two processes drew two hashes (torch 2.13: True, True).
"""

import torch
import torch.distributed as dist
from torch._inductor.codecache import FxGraphCachePickler
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
mesh = init_device_mesh("cpu", (2,))
hash(mesh)
print("pickled state holds _hash:", "_hash" in mesh.__getstate__())
pickler = FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph()))
keys = set()
for drawn in (12345, -67890):  # what hash(mesh) cached in two processes
    mesh._hash = drawn
    keys.add(pickler.dumps([mesh]))
print("cache key bytes differ between processes:", len(keys) > 1)
dist.destroy_process_group()
