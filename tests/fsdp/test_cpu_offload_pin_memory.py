"""``CPUOffloadPolicy(pin_memory=True)`` on a machine without an accelerator, against
torch's FSDP2: pinning host memory needs one, so both raise ``RuntimeError`` at the
same point (``fully_shard`` for materialized parameters, ``to_empty`` for parameters
built on meta) and leave the module as it was. ``tests/gpu/test_cuda.py`` checks
pinned offload on CUDA."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from tests.fsdp.parity_cases import LIBRARIES

pytestmark = pytest.mark.skipif(torch.accelerator.is_available(),
                                reason="pinning works with an accelerator (see tests/gpu)")


def _pin_memory_outcome(fully_shard_fn: Callable, mesh: DeviceMesh, device: str) -> dict:
    """Where sharding a two-layer model built on ``device`` with pinned CPU offload raised."""
    with torch.device(device):
        model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 5))
    policy = CPUOffloadPolicy(pin_memory=True)
    stage = "fully_shard"
    try:
        fully_shard_fn(model[0], mesh=mesh, offload_policy=policy)
        fully_shard_fn(model, mesh=mesh, offload_policy=policy)
        stage = "to_empty"
        if device == "meta":
            model.to_empty(device="cpu")
    except Exception as err:  # noqa: BLE001  (compared between the libraries)
        return {"stage": stage, "type": type(err), "message": str(err),
                "sharded_first_layer": isinstance(model[0], TorchFSDPModule)}
    return {"stage": None}


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_pin_memory_without_accelerator_raises_where_fsdp2_does(fake_mesh: DeviceMesh,
                                                                device: str) -> None:
    outcomes = {name: _pin_memory_outcome(fn, fake_mesh, device) for name, fn in LIBRARIES}
    theirs, ours = outcomes["theirs"], outcomes["ours"]
    assert theirs["stage"] == ("fully_shard" if device == "cpu" else "to_empty")
    assert ours["stage"] == theirs["stage"]
    assert ours["type"] is theirs["type"] is RuntimeError
    assert ours["sharded_first_layer"] == theirs["sharded_first_layer"]
    assert theirs["message"] in ours["message"]  # torch's reason, plus the fix
    assert "CPUOffloadPolicy(pin_memory=False)" in ours["message"]
