"""Rank-side bodies of the TP + FSDP (2-D) tests: a tiny torchtitan-style model,
tensor-parallel on ``mesh["tp"]`` and ``fully_shard``-ed on ``mesh["dp"]``, trained by
torch's FSDP2 and by ours on the same data.

The plan is torchtitan Llama's for its embedding, norms, feed-forward and output:
``RowwiseParallel`` embedding with a sequence-sharded output, ``SequenceParallel``
norms, ``PrepareModuleInput`` gathering the sequence before the feed-forward,
``ColwiseParallel`` / ``RowwiseParallel`` projections (with biases, so ``Replicate``,
``Shard(0)`` and ``Shard(1)`` TP parameters all occur), a ``ColwiseParallel`` output.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import fsdp_traceable
from fsdp_traceable.testing import track_compiles

VOCAB, DIM, HIDDEN, BATCH, SEQ, N_BLOCKS = 16, 8, 16, 2, 4, 2


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN)
        self.w2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.feed_forward = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.feed_forward(self.ffn_norm(x))


class TinyLM(nn.Module):
    """Embedding, ``N_BLOCKS`` blocks of ``block()`` (width ``dim``), norm and output."""

    def __init__(self, block: Callable[[], nn.Module] = Block, dim: int = DIM) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(block() for _ in range(N_BLOCKS))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self(tokens).flatten(0, 1), targets.flatten())


def apply_tp(model: TinyLM, tp_mesh: DeviceMesh) -> None:
    """torchtitan Llama's TP plan, on this model's modules."""
    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),),
                                               desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def apply_fsdp(model: TinyLM, dp_mesh: DeviceMesh, fully_shard: Callable[..., Any],
               **kwargs: Any) -> None:
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)


def two_d_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def sharded_pair(mesh: DeviceMesh, dp_dims: tuple[str, ...] = ("dp",), **kwargs: Any
                 ) -> tuple[TinyLM, TinyLM]:
    """(torch FSDP2's, ours): one init, TP on ``mesh["tp"]``, FSDP on ``mesh[dp_dims]``
    (HSDP where that is 2-D; ``kwargs`` to every ``fully_shard``)."""
    torch.manual_seed(0)
    base = TinyLM()
    models = []
    for fully_shard in (fsdp2_fully_shard, fsdp_traceable.fully_shard):
        model = copy.deepcopy(base)
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh[dp_dims], fully_shard, **kwargs)
        models.append(model)
    return models[0], models[1]


def hsdp_tp_parity(rank: int, world_size: int, steps: int = 2) -> dict[str, Any]:
    """HSDP + TP (3-D) on a (rep=2, shard=2, tp=2) mesh of 8 ranks: FSDP2 and ours,
    TP on ``tp``, HSDP on ``(rep, shard)``, trained eagerly on the same data."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
    theirs, ours = sharded_pair(mesh, dp_dims=("rep", "shard"))
    dp_rank = mesh["rep"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
    result = {"theirs": train(theirs, dp_rank, steps), "ours": train(ours, dp_rank, steps)}
    dist.barrier()
    return result


def meta_init_pair(mesh: DeviceMesh) -> tuple[TinyLM, TinyLM]:
    """(torch FSDP2's, ours) as torchtitan builds them: on meta, TP, FSDP, ``to_empty``,
    then each module's ``reset_parameters`` (DTensor random ops) from one seed."""
    models = []
    for fully_shard in (fsdp2_fully_shard, fsdp_traceable.fully_shard):
        with torch.device("meta"):
            model = TinyLM()
        apply_tp(model, mesh["tp"])
        apply_fsdp(model, mesh["dp"], fully_shard)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
        models.append(model)
    return models[0], models[1]


class SpmdMLP(nn.Module):
    """Two projections whose weights are DTensors on the whole (dp, tp) mesh, colwise then
    rowwise on tp and ``Replicate()`` on dp: FSDP2's ``dp_mesh_dims`` input."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)

    def distribute(self, mesh: DeviceMesh) -> SpmdMLP:
        for linear, tp_placement in ((self.w1, Shard(0)), (self.w2, Shard(1))):
            linear.weight = nn.Parameter(
                distribute_tensor(linear.weight.detach(), mesh, (Replicate(), tp_placement)))
        return self

    def forward(self, x: DTensor) -> DTensor:
        return self.w2(F.silu(self.w1(x)))


def spmd_parity(mesh: DeviceMesh, dp_rank: int, steps: int = 3) -> dict[str, Any]:
    """FSDP2 and ours with ``dp_mesh_dims`` on two ``SpmdMLP`` blocks, the batch a
    DTensor sharded on dp: losses, first-step gradients and final shards."""
    dims = torch.distributed.fsdp.DataParallelMeshDims(shard="dp")
    torch.manual_seed(0)
    bases = [SpmdMLP() for _ in range(2)]
    result = {}
    for name, fully_shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model = nn.Sequential(*(copy.deepcopy(b).distribute(mesh) for b in bases))
        for block in model:
            fully_shard(block, mesh=mesh, dp_mesh_dims=dims)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4)
        losses, grads = [], None
        for step in range(steps):
            local = torch.randn(BATCH * SEQ, DIM, generator=torch.Generator().manual_seed(
                10 * step + dp_rank))
            loss = (model(DTensor.from_local(local, mesh, (Shard(0), Replicate()))) ** 2).mean()
            loss.backward()
            if step == 0:
                grads = grads_with_layouts(model)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.full_tensor().item())
        result[name] = {"losses": losses, "grads": grads, "params": params_with_layouts(model)}
    return result


def flattened_mesh_parity(steps: int = 2) -> dict[str, Any]:
    """FSDP2 and ours on torchtitan's mesh for context parallelism: ``fully_shard`` on the
    ``(dp_shard, cp)`` dims flattened into ``dp_shard_cp`` (each of its ranks trains on
    its own batch, as CP ranks hold their own sequence chunks)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    dp_shard_cp = mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    torch.manual_seed(0)
    base = TinyLM()
    result = {}
    for name, fully_shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model = copy.deepcopy(base)
        apply_fsdp(model, dp_shard_cp, fully_shard)
        # loss_of given: no hook on the compute weights (plain tensors here, no TP)
        result[name] = train(model, dp_shard_cp.get_local_rank(), steps, loss_of=model.loss)
    return result


def batch(step: int, dp_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The batch of dp rank ``dp_rank`` at ``step`` (the same on its TP ranks)."""
    generator = torch.Generator().manual_seed(100 + 10 * step + dp_rank)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return tokens, torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)


def layout(tensor: DTensor) -> tuple:
    return tuple(tensor.device_mesh.mesh_dim_names), tuple(tensor.placements)


def grads_with_layouts(model: nn.Module) -> dict[str, tuple]:
    """Each parameter's gradient: its layout and a copy of its local shard."""
    return {n: (layout(p.grad), p.grad.to_local().clone()) for n, p in model.named_parameters()}


def params_with_layouts(model: nn.Module) -> dict[str, tuple]:
    """Each parameter: its layout and a copy of its local shard."""
    return {n: (layout(p), p.to_local().detach().clone()) for n, p in model.named_parameters()}


def train(model: TinyLM, dp_rank: int, steps: int, loss_of: Callable | None = None,
          backward_context: Callable | None = None, step_of: Callable | None = None
          ) -> dict[str, Any]:
    """Losses, first-step gradients (layout and local values), final shards and layouts;
    eager, also the layouts of the weights a feed-forward computes with. ``step_of``:
    a whole step (forward, loss and backward, as ``compile_step`` takes) instead of
    ``loss_of`` and a backward."""
    seen: dict[str, tuple] = {}
    # Eager only (the hook is not part of what is compiled), on a feed-forward block.
    eager = loss_of is None and step_of is None and hasattr(model.layers[0], "feed_forward")
    if eager:
        hook = model.layers[0].feed_forward.register_forward_hook(
            lambda module, args, output: seen.update(
                w1=layout(module.w1.weight), w2=layout(module.w2.weight)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=1e-4, weight_decay=0.1)
    losses, grads = [], None
    for step in range(steps):
        if step_of is not None:
            loss = step_of(*batch(step, dp_rank))
        else:
            loss = (loss_of or model.loss)(*batch(step, dp_rank))
            with backward_context() if backward_context else contextlib.nullcontext():
                loss.backward()
        if step == 0:
            grads = grads_with_layouts(model)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    if eager:
        hook.remove()
    return {
        "compute_weights": seen,
        "losses": losses,
        "grads": grads,
        "params": params_with_layouts(model),
        "state_dict": {k: layout(v) for k, v in model.state_dict().items()},
    }


def eager_parity(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    """FSDP2 and ours trained eagerly; FSDP2's DCP checkpoint loaded into a fresh model
    of ours; both trained again with bf16 mixed precision, and built on meta; both with
    ``dp_mesh_dims`` (torch 2.12+); both on a flattened ``(dp_shard, cp)`` mesh; both
    on a MoE model with expert parallel (``expert_parallel_cases``); the inputs ours
    must reject."""
    mesh = two_d_mesh()
    theirs, ours = sharded_pair(mesh)
    dp_rank = mesh["dp"].get_local_rank()
    result = {"theirs": train(theirs, dp_rank, 3), "ours": train(ours, dp_rank, 3)}
    dcp.save(theirs.state_dict(), checkpoint_id=checkpoint_dir)
    _, fresh = sharded_pair(mesh)
    state = fresh.state_dict()
    dcp.load(state, checkpoint_id=checkpoint_dir)
    fresh.load_state_dict(state)
    result["loaded"] = {n: (layout(p), p.to_local().detach().clone())
                        for n, p in fresh.named_parameters()}
    # torchtitan's default mixed precision: bf16 compute, fp32 reduction.
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    theirs, ours = sharded_pair(mesh, mp_policy=policy)
    result["bf16"] = {"theirs": train(theirs, dp_rank, 2), "ours": train(ours, dp_rank, 2)}
    theirs, ours = meta_init_pair(mesh)
    result["meta"] = {"theirs": train(theirs, dp_rank, 2), "ours": train(ours, dp_rank, 2)}
    if hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):  # torch 2.12+
        result["spmd"] = spmd_parity(mesh, dp_rank)
    result["dp_shard_cp"] = flattened_mesh_parity()
    result["clip"] = clip_grad_norm_2d(mesh, dp_rank)
    from tests.fsdp.features import expert_parallel_cases  # (which builds on this file's TinyLM)

    result["moe"] = expert_parallel_cases.eager_parity()
    result["errors"] = rejected_inputs(mesh)
    dist.barrier()
    return result


def clip_grad_norm_2d(mesh: DeviceMesh, dp_rank: int) -> dict[str, Any]:
    """``torch.nn.utils.clip_grad_norm_`` (foreach, 2-norm) on TP + FSDP gradients: the
    total norm (a DTensor on the 2-D mesh), its all-reduces and the clipped gradients."""
    result = {}
    for name, model in zip(("theirs", "ours"), sharded_pair(mesh)):
        model.loss(*batch(0, dp_rank)).backward()
        with CommDebugMode() as comm_mode:
            total = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=0.05,
                                                   foreach=True)
        result[name] = {
            "total_norm": total.full_tensor(),
            "placements": [type(p).__name__ for p in total.placements],
            "all_reduces": sum(n for op, n in comm_mode.get_comm_counts().items()
                               if "all_reduce" in str(op)),
            "grads": grads_with_layouts(model),
        }
    return result


def _error(fn: Callable[[], Any]) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 - the test checks the type and message
        return type(err).__name__, str(err)
    return None


def rejected_inputs(mesh: DeviceMesh) -> dict[str, Any]:
    """What our ``fully_shard`` raises (type, message) for inputs FSDP2 cannot shard."""
    errors = {}

    def tp_linear(tp_mesh: DeviceMesh) -> nn.Module:
        return parallelize_module(nn.Linear(4, 4), tp_mesh, ColwiseParallel())

    other_root = init_device_mesh("cpu", (4,), mesh_dim_names=("tp",))
    errors["other_root"] = _error(
        lambda: fsdp_traceable.fully_shard(tp_linear(other_root), mesh=mesh["dp"]))
    errors["overlap"] = _error(
        lambda: fsdp_traceable.fully_shard(tp_linear(mesh["tp"]), mesh=mesh["tp"]))
    partial = nn.Linear(4, 4)
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    errors["partial"] = _error(lambda: fsdp_traceable.fully_shard(partial, mesh=mesh["dp"]))
    dims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if dims is not None:
        errors["spmd_plain"] = _error(lambda: fsdp_traceable.fully_shard(
            nn.Linear(4, 4), mesh=mesh, dp_mesh_dims=dims(shard="dp")))
        sharded_on_dp = nn.Linear(4, 4)
        sharded_on_dp.weight = nn.Parameter(
            DTensor.from_local(torch.ones(2, 4), mesh, (Shard(0), Replicate())))
        errors["spmd_sharded_on_dp"] = _error(lambda: fsdp_traceable.fully_shard(
            sharded_on_dp, mesh=mesh, dp_mesh_dims=dims(shard="dp")))
    return errors



def compiled_parity(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """FSDP2 eager against ours under ``torch.compile(fullgraph=True)`` with compiled
    autograd on ``backend``; with the graph breaks Dynamo counted for ours; the same on
    the expert parallel MoE model (``moe``, ``expert_parallel_cases``)."""
    mesh = two_d_mesh()
    theirs, ours = sharded_pair(mesh)
    dp_rank = mesh["dp"].get_local_rank()
    result = {"theirs": train(theirs, dp_rank, 3)}
    torch._dynamo.reset()
    compiled_loss = torch.compile(ours.loss, backend=backend, fullgraph=True)
    backward_compiler = torch.compile(backend=backend, fullgraph=True)
    with track_compiles() as record:
        result["ours"] = train(ours, dp_rank, 3, compiled_loss,
                               lambda: torch._dynamo.compiled_autograd._enable(backward_compiler))
    result["graph_breaks"] = record.graph_breaks.count
    result["frames"] = [frame.name for frame in record.frames]
    result["recompiles"] = len(record.recompiles)
    result["captures"] = record.compiled_autograd_captures
    from tests.fsdp.features import expert_parallel_cases

    result["moe"] = expert_parallel_cases.compiled_parity(rank, world_size, backend)
    dist.barrier()
    return result
