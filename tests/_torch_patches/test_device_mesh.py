"""The patch of ``fsdp_traceable/_torch_patches/device_mesh.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch._inductor.codecache import FxGraphCachePickler
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.fake_world import fake_process_group

# -- DeviceMesh pickles without its process-local hash --------------------------------

needs_mesh_getstate = pytest.mark.skipif(
    "__getstate__" not in DeviceMesh.__dict__,
    reason="this torch's DeviceMesh has no __getstate__")


def _fx_cache_key_bytes(obj: object) -> bytes:
    """What Inductor's FX graph cache hashes into a key for ``obj``."""
    return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(obj)


@needs_mesh_getstate
def test_torch_still_pickles_the_mesh_hash() -> None:
    assert _torch_patches.drop_mesh_hash_from_pickles()
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        hash(mesh)
        # torch's own state keeps the hash, so its pickles differ between processes.
        assert "_hash" in DeviceMesh.__getstate__.__wrapped__(mesh)


@needs_mesh_getstate
def test_pickled_package_mesh_has_no_hash_and_unpickles_equal() -> None:
    assert _torch_patches.drop_mesh_hash_from_pickles()
    patched = DeviceMesh.__getstate__
    assert _torch_patches.drop_mesh_hash_from_pickles()  # again: not wrapped twice
    assert DeviceMesh.__getstate__ is patched
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        fsdp_traceable.fully_shard(torch.nn.Linear(4, 4), mesh=mesh)
        mesh_hash = hash(mesh)
        assert "_hash" not in mesh.__getstate__()
        restored = pickle.loads(pickle.dumps(mesh))
        assert restored == mesh
        assert hash(restored) == mesh_hash


@needs_mesh_getstate
def test_users_mesh_pickles_as_torch_pickles_it() -> None:
    # After fully_shard, in the same process: a user's own mesh (even one equal to the
    # package's) keeps its hash in its pickles, as torch's own __getstate__ does.
    with fake_process_group(2, reset_dynamo=False):
        fsdp_traceable.fully_shard(torch.nn.Linear(4, 4), mesh=init_device_mesh("cpu", (2,)))
        users = init_device_mesh("cpu", (2,))
        hash(users)
        assert users.__getstate__() == DeviceMesh.__getstate__.__wrapped__(users)
        assert "_hash" in users.__getstate__()
        assert pickle.loads(pickle.dumps(users))._hash == users._hash


@needs_mesh_getstate
def test_fx_graph_cache_key_does_not_depend_on_the_hash_a_process_drew() -> None:
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        hash(mesh)
        _torch_patches.drop_mesh_hash_from_pickles(mesh)  # as fully_shard(mesh=mesh) does
        keys = set()
        for drawn_hash in (12345, -67890):
            mesh._hash = drawn_hash  # what hash(mesh) cached in two different processes
            keys.add(_fx_cache_key_bytes([mesh]))
        assert len(keys) == 1
