"""Rank-side bodies of the expert parallel (EP) + FSDP tests: a tiny torchtitan-style
MoE model, its experts expert-parallel on ``ep`` and ``fully_shard``-ed on
``dp_shard_mod_ep``, its dense layers on the flattened data-parallel mesh, trained by
torch's FSDP2 and by ours on the same data.

The meshes are torchtitan's (``ParallelDims`` with ``dp_shard=4, ep=2``): the world mesh
``(dp_shard_mod_ep=2, dp_shard_in_ep=2)``, ``ep`` the ``dp_shard_in_ep`` dim, ``dp`` both
dims flattened. The MoE block is torchtitan's in miniature: a token-choice top-k router
(``gate`` linear, softmax, top-k) and grouped experts with 3-D weights ``w1``, ``w3``
(experts, hidden, dim) and ``w2`` (experts, dim, hidden), plus a shared expert.

The expert parallel style is torchtitan's ``ExpertParallel`` with another dispatch:
its partition makes the experts' weights DTensors ``Shard(0)`` on ``ep``, and its input
and output functions move tokens between the ep ranks, but with an all-gather of every
ep rank's tokens and gate weights (each rank then runs its local experts on all of them,
a token's output weighted by its gate, zero where it was not routed) and a
reduce-scatter of the outputs, instead of an all-to-all of the routed tokens. Shapes
stay static, so the model compiles whole without data-dependent sizes; the experts'
parameters, their gradients and what FSDP does with them are as with torchtitan's.

``apply_fsdp`` is torchtitan Llama 4's: experts on ``dp_shard_mod_ep``, with
``shard_placement_fn`` returning ``Shard(1)`` (torchtitan's choice when
``dp_shard_mod_ep * ep > num_experts``) or the default ``Shard(0)``, and
``set_gradient_divide_factor`` set to the data-parallel size (with
``set_force_sum_reduction_for_comms``, as gloo has no ``premul_sum``); each block and
the root on ``dp``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

import fsdp_traceable
from fsdp_traceable.testing import track_compiles
from tests.fsdp.features.tensor_parallel_cases import TinyLM, train

# torch 2.13's names; the older ones (deprecated there) before.
_all_gather = getattr(funcol, "all_gather_single_autograd", funcol.all_gather_tensor_autograd)
_reduce_scatter = getattr(funcol, "reduce_scatter_single_autograd",
                          funcol.reduce_scatter_tensor_autograd)

DIM, HIDDEN, N_EXPERTS, TOP_K = 16, 8, 4, 2  # vocabulary, blocks and batches: TinyLM's


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """Experts with 3-D weights; each token's output is weighted by its gate."""

    def __init__(self, hidden: int = HIDDEN) -> None:
        super().__init__()
        self.num_experts = N_EXPERTS
        self.w1 = nn.Parameter(torch.randn(N_EXPERTS, hidden, DIM) / DIM ** 0.5)
        self.w2 = nn.Parameter(torch.randn(N_EXPERTS, DIM, hidden) / hidden ** 0.5)
        self.w3 = nn.Parameter(torch.randn(N_EXPERTS, hidden, DIM) / DIM ** 0.5)

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        # As torchtitan's: expert-parallel weights are used by their local tensors.
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w
                      for w in (self.w1, self.w2, self.w3))
        h = F.silu(torch.einsum("td,ehd->eth", x, w1)) * torch.einsum("td,ehd->eth", x, w3)
        return torch.einsum("eth,edh,te->td", h, w2, gates)


class MoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Module()
        self.router.gate = nn.Linear(DIM, N_EXPERTS, bias=False)
        self.experts = GroupedExperts()
        self.shared_experts = FeedForward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bs, slen, dim = x.shape
        x = x.view(-1, dim)
        scores = F.softmax(self.router.gate(x).to(torch.float32), dim=1)
        top_scores, selected = torch.topk(scores, k=TOP_K, dim=1)
        gates = torch.zeros_like(scores).scatter(1, selected, top_scores)
        out = self.experts(x, gates) + self.shared_experts(x)
        return out.view(bs, slen, dim)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ffn_norm = nn.RMSNorm(DIM)
        self.moe = MoE()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.ffn_norm(x))


def TinyMoE() -> TinyLM:  # noqa: N802  (a model class, in effect)
    """The MoE model: :class:`TinyLM` with MoE blocks at this file's width."""
    return TinyLM(block=Block, dim=DIM)


class ExpertParallel(ParallelStyle):
    """Experts' weights ``Shard(0)`` on the ep mesh; tokens and gates all-gathered over
    it, each rank's share of the outputs reduce-scattered back (see the module doc)."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        local_experts = module.num_experts // device_mesh.size()
        first = device_mesh.get_local_rank() * local_experts

        def partition(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for param_name, param in mod.named_parameters(recurse=False):
                mod.register_parameter(param_name, nn.Parameter(
                    distribute_tensor(param, mesh, [Shard(0)])))

        def dispatch(mod: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            x, gates = (_all_gather(t, 0, mesh) for t in inputs)
            return x, gates[:, first:first + local_experts]

        def combine(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
            return _reduce_scatter(out, "sum", 0, mesh)

        return distribute_module(module, device_mesh, partition, dispatch, combine)


def moe_meshes() -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dp, dp_shard_mod_ep, ep) on 4 ranks, as torchtitan's ``ParallelDims`` builds them."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard_mod_ep", "dp_shard_in_ep"))
    dp = mesh["dp_shard_mod_ep", "dp_shard_in_ep"]._flatten("dp")
    ep = mesh["dp_shard_in_ep"]._flatten("ep")
    return dp, mesh["dp_shard_mod_ep"], ep


def apply_fsdp(model: TinyLM, dp: DeviceMesh, edp: DeviceMesh,
               fully_shard: Callable[..., Any], experts_dim: int, **kwargs: Any) -> None:
    """torchtitan Llama 4's ``apply_fsdp``: experts on ``edp``, then blocks and root on
    dp (``kwargs`` to every ``fully_shard``)."""
    placement_fn = (lambda param: Shard(experts_dim)) if experts_dim else None
    for block in model.layers:
        fully_shard(block.moe.experts, mesh=edp, shard_placement_fn=placement_fn, **kwargs)
        # Gradients are divided by the data-parallel size, not the experts' mesh's.
        block.moe.experts.set_gradient_divide_factor(dp.size())
        # FSDP2 folds that factor into NCCL's premul_sum, which gloo lacks: sum, then
        # divide (what ours does in either case).
        block.moe.experts.set_force_sum_reduction_for_comms(True)
        fully_shard(block, mesh=dp, **kwargs)
    fully_shard(model, mesh=dp, **kwargs)


def moe_pair(meshes: tuple[DeviceMesh, DeviceMesh, DeviceMesh], experts_dim: int,
             **kwargs: Any) -> tuple[TinyLM, TinyLM]:
    """(torch FSDP2's, ours): one init, EP on ``ep``, FSDP as torchtitan's on the
    ``moe_meshes()`` ``meshes``."""
    dp, edp, ep = meshes
    torch.manual_seed(0)
    base = TinyMoE()
    models = []
    for fully_shard in (fsdp2_fully_shard, fsdp_traceable.fully_shard):
        model = copy.deepcopy(base)
        for block in model.layers:
            ExpertParallel()._apply(block.moe.experts, ep)
        apply_fsdp(model, dp, edp, fully_shard, experts_dim, **kwargs)
        models.append(model)
    return models[0], models[1]


def eager_parity(steps: int = 2) -> dict[Any, Any]:
    """FSDP2 and ours trained eagerly, the experts sharded on dim 1 (torchtitan's
    ``shard_placement_fn``) and on dim 0 (the default); what ours rejects."""
    meshes = moe_meshes()
    dp_rank = meshes[0].get_local_rank()
    result: dict[Any, Any] = {}
    for experts_dim in (1, 0):
        theirs, ours = moe_pair(meshes, experts_dim)
        result[experts_dim] = {"theirs": train(theirs, dp_rank, steps),
                               "ours": train(ours, dp_rank, steps)}
    result["errors"] = rejected_inputs(meshes)
    return result


def rejected_inputs(meshes: tuple[DeviceMesh, DeviceMesh, DeviceMesh]
                    ) -> dict[str, tuple[str, str] | None]:
    """What our ``fully_shard`` raises (type, message) for experts FSDP2 cannot shard
    either: on the dense layers' mesh (which holds the ep dim), and ``Shard(1)`` of a
    dim the mesh does not divide (FSDP2: ``NotImplementedError``)."""
    dp, edp, ep = meshes
    cases = {"experts_on_dp": (GroupedExperts(), dp, None),
             "uneven_shard_1": (GroupedExperts(hidden=5), edp, lambda param: Shard(1))}
    errors = {}
    for name, (experts, mesh, placement_fn) in cases.items():
        ExpertParallel()._apply(experts, ep)
        try:
            fsdp_traceable.fully_shard(experts, mesh=mesh, shard_placement_fn=placement_fn)
            errors[name] = None
        except Exception as err:  # noqa: BLE001 - the test checks the type and message
            errors[name] = type(err).__name__, str(err)
    return errors


def compiled_parity(rank: int, world_size: int, backend: str) -> dict[str, Any]:
    """FSDP2 eager against ours under ``torch.compile(fullgraph=True)`` with compiled
    autograd on ``backend`` (experts sharded on dim 1); with Dynamo's graph breaks."""
    meshes = moe_meshes()
    dp_rank = meshes[0].get_local_rank()
    theirs, ours = moe_pair(meshes, 1)
    result = {"theirs": train(theirs, dp_rank, 3)}
    torch._dynamo.reset()
    compiled_loss = torch.compile(ours.loss, backend=backend, fullgraph=True)
    backward_compiler = torch.compile(backend=backend, fullgraph=True)
    with track_compiles() as record:
        result["ours"] = train(ours, dp_rank, 3, compiled_loss,
                               lambda: torch._dynamo.compiled_autograd._enable(backward_compiler))
    result["graph_breaks"] = record.graph_breaks.count
    result["recompiles"] = len(record.recompiles)
    dist.barrier()
    return result
