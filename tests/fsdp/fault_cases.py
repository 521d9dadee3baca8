"""Rank side of the fault tests: a fully_shard-ed model where one rank fails mid-step.

``run_rank`` trains a small model of three sharded blocks on one gloo rank of two,
eager or under ``torch.compile(fullgraph=True)`` (``fsdp2``: torch's own FSDP2, eager,
the comparison ``benchmarks/peer_loss.py`` draws). On the faulty rank, at the fault
step, the fault fires inside block 1's forward (through a custom op, so it also runs
inside a compiled graph) or between forward and backward. The fault either exits the
process (``os._exit(1)``), raises (the process then ends, as with an uncaught
exception), or raises while the process stays alive with its process group open
(``raise_and_linger``), so the other rank can only learn of it by timing out. Each
rank writes its outcome (status, exception type and message, steps done) as JSON.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

from fsdp_traceable import fully_shard
from fsdp_traceable.testing.local_ranks import (
    init_default_group,
    shut_down_process_group,
)

FAULTY_RANK = 1
FAULT_STEP = 1  # step 0 runs (and compiles) on both ranks first
DIM, N_BLOCKS = 16, 3

_plan: dict[str, Any] = {}
_step = [0]


class InjectedFault(RuntimeError):
    """The error the faulty rank raises."""


def _maybe_fault(where: str) -> None:
    """Fires the planned fault if this is the faulty rank, step and place."""
    if (_plan.get("where"), _plan.get("rank"), _step[0]) != (where, dist.get_rank(), FAULT_STEP):
        return
    if _plan["kind"] == "exit":
        os._exit(1)
    raise InjectedFault(f"injected fault on rank {dist.get_rank()} at step {_step[0]} in {where}")


@torch.library.custom_op("fsdp_fault_test::fault_point", mutates_args=())
def fault_point(x: torch.Tensor, where: str) -> torch.Tensor:
    """Identity that runs :func:`_maybe_fault` at run time, compiled or not; its
    backward is the same op at ``<where>_backward``."""
    _maybe_fault(where)
    return x.clone()


@fault_point.register_fake
def _(x: torch.Tensor, where: str) -> torch.Tensor:
    return torch.empty_like(x)


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: torch.Tensor) -> None:
    ctx.where = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
    return fault_point(grad, f"{ctx.where}_backward"), None


fault_point.register_autograd(_backward, setup_context=_setup_context)


class Block(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index
        self.w1 = nn.Linear(DIM, DIM)
        self.w2 = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = fault_point(torch.relu(self.w1(x)), f"block{self.index}")
        return x + self.w2(h)


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(i) for i in range(N_BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self(x), y)


def _train(mode: str, outcome: dict[str, Any], steps: int = 3) -> None:
    torch.manual_seed(0)
    model = Model()
    shard = fsdp2_fully_shard if mode == "fsdp2" else fully_shard
    for block in model.blocks:
        shard(block)
    shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_fn = torch.compile(model.loss, fullgraph=True) if mode == "compile" else model.loss
    generator = torch.Generator().manual_seed(dist.get_rank())
    for step in range(steps):
        _step[0] = step
        outcome["step_started_at"] = time.monotonic()
        x, y = torch.randn(4, DIM, generator=generator), torch.randn(4, generator=generator)
        loss = loss_fn(x, y)
        _maybe_fault("before_backward")
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        outcome["steps_done"] = step + 1


def outcome_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, f"rank{rank}.json")


def run_rank(
    rank: int, world_size: int, port: int, mode: str, where: str, kind: str, out_dir: str,
    timeout_s: float,
) -> None:
    """One rank's process: train, and write what happened to ``outcome_path``.

    Args:
        rank, world_size, port: the gloo rendezvous on 127.0.0.1.
        mode: ``"eager"``, ``"compile"`` or ``"fsdp2"`` (torch's FSDP2, eager).
        where: the fault point: ``"block<i>"`` (inside block i's forward),
            ``"block<i>_backward"`` (inside its backward) or ``"before_backward"``.
        kind: ``"exit"``, ``"raise"`` or ``"raise_and_linger"``.
        out_dir: where the outcome JSON goes.
        timeout_s: the process group's collective timeout.
    """
    torch.set_num_threads(1)
    init_default_group(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s, backend="gloo")
    _plan.update(rank=FAULTY_RANK, where=where, kind=kind)
    outcome: dict[str, Any] = {"rank": rank, "steps_done": 0}
    error: Exception | None = None
    try:
        _train(mode, outcome)
        outcome["status"] = "finished"
    except Exception as exc:  # noqa: BLE001  (recorded for the parent test)
        error = exc
        outcome.update(
            status="raised", type=type(exc).__name__,
            bases=[cls.__name__ for cls in type(exc).__mro__], message=str(exc)[:4000],
            seconds_in_failed_step=time.monotonic() - outcome["step_started_at"],
        )
    with open(outcome_path(out_dir, rank) + ".tmp", "w") as f:
        json.dump(outcome, f)
    os.replace(outcome_path(out_dir, rank) + ".tmp", outcome_path(out_dir, rank))
    if isinstance(error, InjectedFault):
        if kind == "raise_and_linger":
            # Stay alive, process group open, until the other rank has given up and
            # torn its process group down, so closing this rank's connections cannot
            # race with that teardown.
            deadline = time.monotonic() + 10 * timeout_s
            peer_closed = _closed_path(out_dir, 1 - rank)
            while not os.path.exists(peer_closed) and time.monotonic() < deadline:
                time.sleep(0.2)
            os._exit(0)
        raise error  # as an uncaught exception would: traceback, exit code 1
    error = None  # its traceback holds the model
    shut_down_process_group()
    open(_closed_path(out_dir, rank), "w").close()


def _closed_path(out_dir: str, rank: int) -> str:
    """Written by a rank once its process group is destroyed."""
    return outcome_path(out_dir, rank) + ".closed"
