"""``DeviceMesh`` pickles without its process-local hash: the meshes of the package's
parameters only."""

from __future__ import annotations

import functools
import weakref
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

# id -> weak reference of every mesh a fully_shard call shards on (DeviceMesh compares
# by value, so a user's equal mesh must not count: identity only).
_PACKAGE_MESHES: dict[int, weakref.ref] = {}


def _own(mesh: DeviceMesh) -> None:
    key = id(mesh)
    _PACKAGE_MESHES[key] = weakref.ref(mesh, lambda _, key=key: _PACKAGE_MESHES.pop(key, None))


def is_package_mesh(mesh: DeviceMesh) -> bool:
    """Whether ``mesh`` is one a ``fully_shard`` call shards on (this very object)."""
    ref = _PACKAGE_MESHES.get(id(mesh))
    return ref is not None and ref() is mesh


def drop_mesh_hash_from_pickles(*meshes: DeviceMesh) -> bool:
    """The package's ``DeviceMesh`` objects pickle without their process-local hash, so
    compile caches hit across restarts.

    Where a graph's inputs hold a ``DeviceMesh`` (torch 2.13 passes every DTensor
    parameter's mesh as an opaque input), Inductor's FX graph cache pickles the mesh
    into the graph's cache key. ``DeviceMesh.__getstate__`` keeps ``_hash``, the
    mesh's Python hash cached on first use: it differs in every process, so the key
    did too and a new process never found the graphs the last one compiled. A hash is
    only meaningful in the process that computed it (``DeviceMesh.__hash__``
    recomputes a missing one), so a pickle of one of ``meshes`` (and of every mesh
    given to an earlier call) leaves it out; every other mesh pickles as torch pickles
    it (``docs/repros/device_mesh_pickled_hash.py``).

    Applies to: every torch whose ``DeviceMesh`` defines ``__getstate__`` (2.11 to
    2.15); torch's own ``__getstate__`` stays reachable as ``__wrapped__``.

    Args:
        *meshes: meshes of the package's parameters (``fully_shard`` passes its mesh
            and its parameters' meshes), from now on pickled without their hash.

    Returns:
        Whether pickles leave the hash out (``False`` where ``DeviceMesh`` has no
        ``__getstate__`` of its own).
    """
    original = DeviceMesh.__dict__.get("__getstate__")
    if original is None:
        return False
    for mesh in meshes:
        _own(mesh)
    if getattr(original, "_fsdp_traceable_drops_hash", False):
        return True

    @functools.wraps(original)
    def __getstate__(self: DeviceMesh) -> dict[str, Any]:
        state = original(self)
        if not is_package_mesh(self):
            return state
        state = dict(state)
        state.pop("_hash", None)
        return state

    __getstate__._fsdp_traceable_drops_hash = True
    DeviceMesh.__getstate__ = __getstate__
    return True
