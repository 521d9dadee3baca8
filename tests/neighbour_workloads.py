"""A user's own distributed workloads, run in a process where a model of ours trained
first (each block and the whole model compiled with compiled autograd, and
``compile_step``: ``python tests/neighbour_workloads.py ours``) or in one that never imports
fsdp_traceable (``... alone``); prints, as JSON, what each workload gives: losses and
parameters, graphs compiled, warnings logged. ``tests/test_import_side_effects.py``
compares the two.

One gloo rank: torch's FSDP2 with each block compiled, tensor parallel compiled with its
backward under compiled autograd, a hand-written sequence-parallel layer (a funcol
all-gather) under compiled autograd, a whole step compiled with ``trace_autograd_ops``,
``nested_compile_region``, a selective activation
checkpoint under ``torch.compile`` (torch's ``context_fn`` warning), and a DeviceMesh
pickled.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
from torch._dynamo import compiled_autograd
from torch._dynamo.utils import counters
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

BACKEND = "aot_eager"
# Where torch logs its warning about a checkpoint's context_fn under torch.compile.
CHECKPOINT_WARNING_LOGGER = "torch._higher_order_ops.wrap"


class _Logged(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _mlp() -> nn.Sequential:
    return nn.Sequential(*(nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(2)),
                         nn.Linear(8, 1))


def _train(model: nn.Module, steps: int = 2, compiled_backward: bool = False) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    losses = []
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        if compiled_backward:
            with compiled_autograd._enable(torch.compile(backend=BACKEND)):
                loss.backward()
        else:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    params = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    return {"losses": losses, "params": [p.detach().flatten().tolist() for p in params]}


def _ours(mesh) -> dict:
    """Trains a model of ours; returns the checkpointed regions whose ``context_fn``
    warning our patch saw (through the function it reads them with) and what was logged."""
    import fsdp_traceable
    from fsdp_traceable._torch_patches import checkpoint_warning

    seen = []
    context_fn_of = checkpoint_warning._checkpointed_context_fn

    def recorded(frame):
        seen.append(getattr(context_fn_of(frame), "__name__", None))
        return context_fn_of(frame)

    checkpoint_warning._checkpointed_context_fn = recorded
    logged = _Logged()
    logging.getLogger(CHECKPOINT_WARNING_LOGGER).addHandler(logged)

    torch.manual_seed(1)
    model = _mlp()
    for module in (*model, model):
        fsdp_traceable.fully_shard(module, mesh=mesh)
    model.compile(backend=BACKEND)
    _train(model, compiled_backward=True)
    if fsdp_traceable.whole_step.dynamo_traces_backward_into_dtensors():
        torch.manual_seed(1)
        model = _mlp()
        for module in (*model, model):
            fsdp_traceable.fully_shard(module, mesh=mesh)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss.detach()

        fsdp_traceable.compile_step(step, backend=BACKEND)(torch.randn(4, 8))
    logging.getLogger(CHECKPOINT_WARNING_LOGGER).removeHandler(logged)
    return {"regions_seen": sorted(set(seen)), "warnings": logged.messages}


def _fsdp2_blocks(mesh) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _mlp()
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
        block.compile(backend=BACKEND)
    fully_shard(model, mesh=mesh)
    return _train(model)


def _tensor_parallel(mesh) -> dict:
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return _train(torch.compile(model, backend=BACKEND), compiled_backward=True)


class _SequenceParallel(nn.Module):
    """Gathers its sequence shards with funcol, then a linear layer."""

    def __init__(self, mesh) -> None:
        super().__init__()
        self.mesh, self.linear = mesh, nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(funcol.all_gather_tensor(x, 0, self.mesh))


def _sequence_parallel(mesh) -> dict:
    torch.manual_seed(0)
    return _train(torch.compile(_SequenceParallel(mesh), backend=BACKEND),
                  compiled_backward=True)


def _whole_step() -> dict:
    """Forward, loss and backward in one graph, as torch documents it (where its Dynamo
    traces backward())."""
    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        return {}
    torch.manual_seed(0)
    model = _mlp()
    x = torch.randn(4, 8)

    @torch.compile(backend=BACKEND, fullgraph=True)
    def step(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss.detach()

    with torch._dynamo.config.patch(trace_autograd_ops=True):
        loss = step(x)
    return {"loss": loss.item(), "grads": [p.grad.flatten().tolist() for p in model.parameters()]}


def _nested_region() -> dict:
    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ weight)

    weight = torch.randn(8, 8, requires_grad=True, generator=torch.Generator().manual_seed(0))
    out = torch.compile(lambda x: block(block(x, weight), weight).sum(), backend=BACKEND)(
        torch.ones(4, 8))
    out.backward()
    return {"out": out.item(), "grad": weight.grad.flatten().tolist()}


def _policy(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _context_fn():
    return create_selective_checkpoint_contexts(_policy)


def _selective_checkpoint() -> dict:
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return checkpoint(lambda x: torch.relu(x @ weight).sin(), x, use_reentrant=False,
                          context_fn=_context_fn)

    weight = torch.ones(8, 8, requires_grad=True)
    torch.compile(block, backend=BACKEND)(torch.ones(4, 8), weight).sum().backward()
    return {"grad": weight.grad.flatten().tolist()}


def main(which: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                                rank=0, world_size=1)
        mesh = init_device_mesh("cpu", (1,))
        ours = _ours(mesh) if which == "ours" else None
        logged = _Logged()
        logging.getLogger(CHECKPOINT_WARNING_LOGGER).addHandler(logged)
        graphs_before = counters["stats"]["unique_graphs"]
        captures_before = counters["compiled_autograd"]["captures"]
        result = {
            "fsdp2_blocks": _fsdp2_blocks(mesh),
            "tensor_parallel": _tensor_parallel(mesh),
            "sequence_parallel": _sequence_parallel(mesh),
            "whole_step": _whole_step(),
            "nested_region": _nested_region(),
            "selective_checkpoint": _selective_checkpoint(),
            "mesh_pickle": pickle.loads(pickle.dumps(init_device_mesh("cpu", (1,)))).mesh.tolist(),
            "graphs": counters["stats"]["unique_graphs"] - graphs_before,
            "compiled_autograd_graphs": counters["compiled_autograd"]["captures"] - captures_before,
            "warnings": logged.messages,
            "imported_ours": "fsdp_traceable" in sys.modules,
        }
        if ours is not None:
            result["ours"] = ours
        dist.destroy_process_group()
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
