"""``DeviceMesh`` pickles without its process-local hash."""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.device_mesh import DeviceMesh


def drop_mesh_hash_from_pickles() -> bool:
    """``DeviceMesh`` pickles without its process-local hash, so compile caches hit
    across restarts.

    Where a graph's inputs hold a ``DeviceMesh`` (torch 2.13 passes every DTensor
    parameter's mesh as an opaque input), Inductor's FX graph cache pickles the mesh
    into the graph's cache key. ``DeviceMesh.__getstate__`` keeps ``_hash``, the
    mesh's Python hash cached on first use: it differs in every process, so the key
    did too and a new process never found the graphs the last one compiled. A hash is
    only meaningful in the process that computed it (``DeviceMesh.__hash__``
    recomputes a missing one), so every pickle of a mesh leaves it out.

    Applies to: every torch whose ``DeviceMesh`` defines ``__getstate__`` (2.11 to
    2.14); torch's own ``__getstate__`` stays reachable as ``__wrapped__``.

    Returns:
        Whether pickles leave the hash out (``False`` where ``DeviceMesh`` has no
        ``__getstate__`` of its own).
    """
    original = DeviceMesh.__dict__.get("__getstate__")
    if original is None:
        return False
    if getattr(original, "_fsdp_traceable_drops_hash", False):
        return True

    @functools.wraps(original)
    def __getstate__(self: DeviceMesh) -> dict[str, Any]:
        state = dict(original(self))
        state.pop("_hash", None)
        return state

    __getstate__._fsdp_traceable_drops_hash = True
    DeviceMesh.__getstate__ = __getstate__
    return True
