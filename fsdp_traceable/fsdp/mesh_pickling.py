"""DeviceMesh pickles without the process-local hash, so compile caches hit across restarts.

Where a graph's inputs hold a ``DeviceMesh`` (torch 2.13 passes every DTensor
parameter's mesh as an opaque input), Inductor's FX graph cache pickles the mesh into
the graph's cache key. ``DeviceMesh.__getstate__`` keeps ``_hash``, the mesh's Python
hash cached on first use: it differs in every process, so the key did too and a new
process never found the graphs the last one compiled. A hash is only meaningful in
the process that computed it (``DeviceMesh.__hash__`` recomputes a missing one), so
:func:`install` leaves it out of every pickle of a mesh.
"""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.device_mesh import DeviceMesh

__all__ = ["install"]


def install() -> None:
    """Makes ``DeviceMesh.__getstate__`` leave out the process-local hash (once)."""
    original = DeviceMesh.__dict__.get("__getstate__")
    if original is None or getattr(original, "_fsdp_traceable_drops_hash", False):
        return

    @functools.wraps(original)
    def __getstate__(self: DeviceMesh) -> dict[str, Any]:
        state = dict(original(self))
        state.pop("_hash", None)
        return state

    __getstate__._fsdp_traceable_drops_hash = True
    DeviceMesh.__getstate__ = __getstate__
