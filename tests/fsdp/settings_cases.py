"""Rank-side bodies of the ``FSDPModule`` settings parity tests: each shards one model
with both libraries, applies the same setter calls to both and trains them the same
way (see :func:`~tests.fsdp.feature_cases.train`)."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import fsdp_traceable
from fsdp_traceable.models.transformer import Transformer
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import (
    count_all_gathers,
    count_calls,
    count_reduce_scatters,
    fsdp_modules,
    seeded_transformer,
    train,
)
from tests.fsdp.parity_utils import SMALL, batch, shard_copies

Setup = Callable[[nn.Module], None]


def _train_both_with(setup: Setup, rank: int, world_size: int, *, mesh=None,
                     **train_kwargs: Any) -> dict[str, Any]:
    shard_kwargs = {"mesh": mesh} if mesh is not None else {}
    theirs, ours = shard_copies(seeded_transformer(), **shard_kwargs)
    result = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        setup(model)
        result[name] = train(model, rank, world_size, **train_kwargs)
    return result


def _on_every_module(method: str, *args: Any, **kwargs: Any) -> Setup:
    def setup(model: nn.Module) -> None:
        for module in fsdp_modules(model):
            getattr(module, method)(*args, **kwargs)
    return setup


def divide_factor(rank: int, world_size: int, how: str) -> dict[str, Any]:
    """``set_gradient_divide_factor``: the shard size (FSDP2 averages in the collective),
    or twice the world size with sum-only comms (FSDP2's ``premul_sum`` needs NCCL)."""
    if how == "shard_size":
        return _train_both_with(_on_every_module("set_gradient_divide_factor", world_size),
                                rank, world_size)

    def setup(model: nn.Module) -> None:
        for module in fsdp_modules(model):
            module.set_gradient_divide_factor(2.0 * world_size)
            module.set_force_sum_reduction_for_comms(True)
    return _train_both_with(setup, rank, world_size)


def deprecated_divide_factor(rank: int, world_size: int) -> dict[str, Any]:
    """The deprecated ``set_reduce_scatter_divide_factor`` warns and sets the same factor."""
    theirs, ours = shard_copies(seeded_transformer())
    caught = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        with warnings.catch_warnings(record=True) as records:
            warnings.simplefilter("always")
            model.set_reduce_scatter_divide_factor(float(world_size))
        caught[name] = sorted({type(r.message).__name__ for r in records})
    return {"warnings": caught, "factor": ours._fsdp_group.settings.gradient_divide_factor}


def unshard_async_op(rank: int, world_size: int) -> dict[str, Any]:
    return _train_both_with(_on_every_module("_set_unshard_async_op", True), rank, world_size)


def force_sum(rank: int, world_size: int) -> dict[str, Any]:
    return _train_both_with(_on_every_module("set_force_sum_reduction_for_comms", True),
                            rank, world_size)


class WithUnusedLayer(nn.Module):
    """A transformer plus a linear layer forward never calls (in the root group)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = seeded_transformer()
        self.unused = nn.Linear(4, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.model(tokens)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return Transformer.loss(self, tokens, targets)


def unused_params_reduced(rank: int, world_size: int) -> dict[str, Any]:
    """``set_reduce_scatter_unused_params(True)``: the unused layer gets zero gradients
    through the reduce-scatter (the count of reduce-scatters is FSDP2's)."""
    result = {}
    for name, fully_shard_fn in (("theirs", fsdp2_fully_shard),
                                 ("ours", fsdp_traceable.fully_shard)):
        torch.manual_seed(0)
        model = WithUnusedLayer()
        for layer in model.model.layers:
            fully_shard_fn(layer)
        fully_shard_fn(model)
        model.set_reduce_scatter_unused_params(True)
        result[name] = train(model, rank, world_size, steps=2)
    return result


def hsdp_all_reduce_every_other(rank: int, world_size: int) -> dict[str, Any]:
    """HSDP on a (2, 2) mesh: 2 microbatches, the first without the all-reduce."""
    mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))

    def before(model: nn.Module, micro: int, microbatches: int) -> None:
        model.set_requires_all_reduce(micro == microbatches - 1)

    theirs, ours = shard_copies(seeded_transformer(), mesh=mesh)
    result = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        with count_calls(dist, "all_reduce") as all_reduces:
            result[name] = train(model, rank, world_size, microbatches=2,
                                 before_microbatch=before)
        result[name]["all_reduces"] = all_reduces[0]
    return result


def all_reduce_hook(rank: int, world_size: int, hsdp: bool) -> dict[str, Any]:
    """A hook that halves the reduced bucket in place, on every module; calls counted."""
    mesh = None
    if hsdp:
        mesh = init_device_mesh("cpu", (2, world_size // 2),
                                mesh_dim_names=("replicate", "shard"))
    calls = {"theirs": 0, "ours": 0}

    def setup_for(name: str) -> Setup:
        def hook(reduce_output: torch.Tensor) -> None:
            calls[name] += 1
            reduce_output.mul_(0.5)

        return _on_every_module("set_all_reduce_hook", hook)

    shard_kwargs = {"mesh": mesh} if mesh is not None else {}
    theirs, ours = shard_copies(seeded_transformer(), **shard_kwargs)
    result = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        setup_for(name)(model)
        result[name] = train(model, rank, world_size)
    result["calls"] = calls
    return result


def explicit_prefetch(rank: int, world_size: int) -> dict[str, Any]:
    """4 blocks; each prefetches the next two in forward and the previous two in
    backward. Records, from inside the first block's forward, which later blocks'
    all-gathers are already in flight, and counts the collectives."""
    theirs, ours = shard_copies(seeded_transformer(dataclasses.replace(SMALL, n_layers=4)))
    in_flight: list[list[bool]] = []

    def record(module: nn.Module, args: Any, output: Any) -> None:
        in_flight.append([b._fsdp_group.has_prefetch for b in ours.layers[1:]])

    handle = ours.layers[0].feed_forward.register_forward_hook(record)
    result = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        blocks = list(model.layers)
        for i, block in enumerate(blocks):
            block.set_modules_to_forward_prefetch(blocks[i + 1 : i + 3])
            block.set_modules_to_backward_prefetch(blocks[max(i - 2, 0) : i][::-1])
        with count_all_gathers() as gathers, count_reduce_scatters() as scatters:
            result[name] = train(model, rank, world_size, steps=2)
        result[name]["all_gathers"] = gathers[0]
        result[name]["reduce_scatters"] = scatters[0]
    handle.remove()
    result["in_flight"] = in_flight
    return result


def unshard_in_backward_off(rank: int, world_size: int) -> dict[str, Any]:
    """torchtitan's grouping with every group resharding after forward, and
    ``set_unshard_in_backward(False)`` on the root, which holds only the embeddings
    (their backward reads no parameter): trains as FSDP2 does, with as many
    all-gathers. On a block, whose backward reads its parameters, ours raises before
    the block's backward collectives."""
    result = {}
    for name, fully_shard_fn in (("theirs", fsdp2_fully_shard),
                                 ("ours", fsdp_traceable.fully_shard)):
        model = parity_cases.titan_shard(seeded_transformer(), fully_shard_fn,
                                         reshard_after_forward=True)
        model.set_unshard_in_backward(False)
        with count_all_gathers() as gathers:
            result[name] = train(model, rank, world_size)
        result[name]["all_gathers"] = gathers[0]
    ours = parity_cases.titan_shard(seeded_transformer(), fsdp_traceable.fully_shard)
    ours.layers[0].set_unshard_in_backward(False)
    loss = ours.loss(*batch(0, rank, world_size))
    try:
        loss.backward()
        result["block_error"] = None
    except RuntimeError as err:
        result["block_error"] = str(err)
    return result


class CountingAllGather:
    """FSDP2's ``AllGather`` interface over c10d, counting its calls and allocations."""

    def __init__(self) -> None:
        self.calls = self.allocations = 0

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        self.allocations += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    """FSDP2's ``ReduceScatter`` interface over c10d, counting its calls and allocations."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def custom_comms(rank: int, world_size: int) -> dict[str, Any]:
    """``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on every module: the same
    numbers as FSDP2 with the same comms, and every collective goes through them."""
    theirs, ours = shard_copies(seeded_transformer())
    result = {}
    for name, model in (("theirs", theirs), ("ours", ours)):
        all_gather, reduce_scatter = CountingAllGather(), CountingReduceScatter()
        for module in fsdp_modules(model):
            module.set_custom_all_gather(all_gather)
            module.set_custom_reduce_scatter(reduce_scatter)
        with count_calls(dist, "all_gather_into_tensor") as gathers:
            result[name] = train(model, rank, world_size)
        result[name]["counts"] = {
            "all_gather_calls": all_gather.calls, "c10d_all_gathers": gathers[0],
            "reduce_scatter_calls": reduce_scatter.calls,
            "reduce_scatter_allocations": reduce_scatter.allocations,
        }
    return result


def process_group_allocation(rank: int, world_size: int) -> dict[str, Any]:
    """``set_allocate_memory_from_process_group_for_comm(True)`` on every module (gloo has
    no allocator of its own: plain buffers), and ``set_symm_mem_for_comm()``, which needs
    NCCL: the error each library raises on CPU."""
    result = _train_both_with(_on_every_module(
        "set_allocate_memory_from_process_group_for_comm", True), rank, world_size)
    for name, model in zip(("theirs", "ours"), shard_copies(seeded_transformer())):
        try:
            model.set_symm_mem_for_comm()
            result[name]["symm_mem_error"] = None
        except Exception as error:  # noqa: BLE001 - the error itself is the result
            result[name]["symm_mem_error"] = f"{type(error).__name__}: {error}"
    return result
