"""Rank-side body of the registered-parameters test: what ``named_parameters()`` holds
(DTensor or plain tensor, global shape, full values) at each point of a step, under
torch's FSDP2 and ours, on the same model and seed.

FSDP2 registers a group's unsharded parameters on its modules while the group is
unsharded and the sharded DTensors otherwise; the parent test compares ours with it
point by point.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as FSDP2Module
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor

import fsdp_traceable

LIBRARIES = (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard))
RESHARD_AFTER_FORWARD = (True, False, 2, None)
DIM = 6

# (name, DTensor or not, global shape, full value) per parameter.
Snapshot = list[tuple[str, bool, tuple[int, ...], torch.Tensor]]


def snapshot(model: nn.Module) -> Snapshot:
    """What ``model.named_parameters()`` registers now (``full_tensor()`` is a
    collective: every rank takes the same snapshots)."""
    return [(name, isinstance(p, DTensor), tuple(p.shape),
             (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone())
            for name, p in model.named_parameters()]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, 2 * DIM)
        self.lin2 = nn.Linear(2 * DIM, DIM)
        # Set on the last block: called inside its forward.
        self.probe: Callable[[], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.probe is not None:
            self.probe()
        return x + self.lin2(torch.relu(self.lin1(x)))


class _Model(nn.Module):
    """Two blocks, each its own group, and a head in the root's group."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _sharded(fully_shard_fn: Callable, reshard: bool | int | None) -> nn.Module:
    torch.manual_seed(0)
    model = _Model()
    for block in model.blocks:
        fully_shard_fn(block, reshard_after_forward=reshard)
    fully_shard_fn(model, reshard_after_forward=reshard)
    return model


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules()
            if isinstance(m, (FSDP2Module, fsdp_traceable.FSDPModule))]


def _points(model: nn.Module, rank: int) -> dict[str, Snapshot]:
    """The snapshots of one model along a step, then a step that keeps the parameters
    unsharded after backward, then ``unshard()``."""
    points: dict[str, Snapshot] = {"init": snapshot(model)}
    last = model.blocks[-1]
    last.probe = lambda: points.__setitem__("inside_forward", snapshot(model))
    x = torch.randn(3, DIM, generator=torch.Generator().manual_seed(rank))
    loss = model(x).sum()
    last.probe = None
    points["after_forward"] = snapshot(model)
    loss.backward()
    points["after_backward"] = snapshot(model)
    for module in _fsdp_modules(model):
        module.reshard()
    points["after_reshard"] = snapshot(model)
    model.set_reshard_after_backward(False)
    model(x).sum().backward()
    points["kept_after_backward"] = snapshot(model)
    for module in _fsdp_modules(model):
        module.reshard()
    points["after_second_reshard"] = snapshot(model)
    model.blocks[0].unshard()
    points["after_unshard"] = snapshot(model)
    model.blocks[0].reshard()
    return points


def registered_params(rank: int, world_size: int) -> dict[str, Any]:
    """``{"<library>_<reshard_after_forward>": {point: snapshot}}``."""
    return {f"{name}_{reshard}": _points(_sharded(fully_shard_fn, reshard), rank)
            for reshard in RESHARD_AFTER_FORWARD for name, fully_shard_fn in LIBRARIES}
