"""Rank-side bodies of the PP + FSDP tests: a tiny residual model cut into pipeline
stages on ``mesh["pp"]``, each stage ``fully_shard``-ed per block and at its root on
``mesh["dp"]``, trained by ``torch.distributed.pipelining`` schedules with torch's FSDP2
and with ours on the same data; the collectives each step issues are counted.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
)

import fsdp_traceable

DIM, N_BLOCKS, MICROBATCHES, MICROBATCH, STEPS = 8, 4, 4, 2, 2
# name: (schedule class, stages per rank, schedule keyword arguments)
SCHEDULES: dict[str, tuple[type, int, dict[str, Any]]] = {
    "gpipe": (ScheduleGPipe, 1, {}),
    "1f1b": (Schedule1F1B, 1, {}),
    "interleaved_1f1b": (ScheduleInterleaved1F1B, 2, {}),
}
# torch 2.15's multi-stage schedules can leave each stage's gradient reduction in flight
# until the next one starts: they read ``_get_fsdp_state()._comm_ctx`` to refuse stages
# sharing a communication context, then call ``finalize_backward(async_op=True)`` and
# wait on the handle later.
if "defer_reduce_grad_wait" in inspect.signature(ScheduleInterleaved1F1B.__init__).parameters:
    SCHEDULES["interleaved_1f1b_deferred_wait"] = (
        ScheduleInterleaved1F1B, 2, {"defer_reduce_grad_wait": True})
# The c10d calls FSDP2's and our eager collectives go through (torch 2.11 lacks the
# *_single names).
_ALL_GATHERS = ("all_gather_into_tensor", "all_gather_single")
_REDUCE_SCATTERS = ("reduce_scatter_tensor", "reduce_scatter_single")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Stage(nn.Module):
    """A parameter of the stage's own (its root group's) and consecutive blocks."""

    def __init__(self, blocks: list[Block]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Scaled first, so every block's backward reads its weight (the input
        # gradient), on the first stage too: ours all-gathers a group in backward only
        # when its backward reads the parameters, FSDP2 always.
        x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


def _loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _stages(pp_rank: int, stages_per_rank: int, dp_mesh: DeviceMesh,
            fully_shard_fn: Callable[..., Any]) -> list[tuple[int, Stage]]:
    """This rank's stages (index, module), sharded; every rank builds the same blocks."""
    torch.manual_seed(0)
    blocks = [Block() for _ in range(N_BLOCKS)]
    n_stages = 2 * stages_per_rank
    per_stage = N_BLOCKS // n_stages
    result = []
    for index in range(pp_rank, n_stages, 2):  # interleaved: stages r and r + 2
        module = Stage(copy.deepcopy(blocks[index * per_stage:(index + 1) * per_stage]))
        for block in module.layers:
            fully_shard_fn(block, mesh=dp_mesh)
        fully_shard_fn(module, mesh=dp_mesh)
        result.append((index, module))
    return result


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Counts the outermost all-gather and reduce-scatter c10d calls while open."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    depth = [0]
    saved = {}

    def counted(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                counts[kind] += 1
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for kind, names in (("all_gather", _ALL_GATHERS), ("reduce_scatter", _REDUCE_SCATTERS)):
        for name in names:
            if hasattr(dist, name):
                saved[name] = getattr(dist, name)
                setattr(dist, name, counted(kind, saved[name]))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def train(mesh: DeviceMesh, schedule: str, fully_shard_fn: Callable[..., Any]) -> dict[str, Any]:
    """``STEPS`` SGD steps of ``schedule``: last-stage losses, every parameter's final
    local shard (by stage and name) and each step's collective counts."""
    schedule_cls, stages_per_rank, schedule_kwargs = SCHEDULES[schedule]
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    modules = _stages(pp_rank, stages_per_rank, mesh["dp"], fully_shard_fn)
    stages = [PipelineStage(m, i, 2 * stages_per_rank, torch.device("cpu"),
                            group=mesh["pp"].get_group()) for i, m in modules]
    if stages_per_rank == 1:
        pipeline = schedule_cls(stages[0], MICROBATCHES, loss_fn=_loss, **schedule_kwargs)
    else:
        pipeline = schedule_cls(stages, MICROBATCHES, loss_fn=_loss, **schedule_kwargs)
    params = [p for _, m in modules for p in m.parameters()]
    optim = torch.optim.SGD(params, lr=0.1)
    has_last = any(s.is_last for s in stages)
    has_first = any(s.is_first for s in stages)
    result: dict[str, Any] = {"losses": [], "counts": []}
    for step in range(STEPS):
        generator = torch.Generator().manual_seed(100 * step + dp_rank)
        batch = torch.randn(MICROBATCHES * MICROBATCH, DIM, generator=generator)
        target = torch.randn(MICROBATCHES * MICROBATCH, DIM, generator=generator)
        losses: list[torch.Tensor] = []
        with counting_collectives() as counts:
            pipeline.step(*((batch,) if has_first else ()),
                          target=target if has_last else None,
                          losses=losses if has_last else None)
        optim.step()
        optim.zero_grad()
        result["losses"].append([loss.item() for loss in losses])
        result["counts"].append(dict(counts))
    result["shards"] = {f"{i}.{name}": p.to_local().detach().clone()
                        for i, m in modules for name, p in m.named_parameters()}
    return result


def pipeline_parity(rank: int, world_size: int) -> dict[str, Any]:
    """Every schedule with FSDP2 and with ours on a (pp=2, dp=2) mesh."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    result: dict[str, Any] = {}
    for schedule in SCHEDULES:
        result[schedule] = {
            "theirs": train(mesh, schedule, fsdp2_fully_shard),
            "ours": train(mesh, schedule, fsdp_traceable.fully_shard),
        }
    dist.barrier()
    return result
