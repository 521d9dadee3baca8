"""Parity with torch's own FSDP2 on real gloo ranks, bitwise.

Each rank builds the same small model (uneven dim-0 sizes, fewer rows than ranks,
a ``Shard(1)`` weight), applies ``torch.distributed.fsdp.fully_shard`` to it and keeps
an unsharded replica. From FSDP2's ``FSDPParam``s we build our :class:`ShardInfo`s and
check: the sharding metadata matches; our all-gather + copy-out of FSDP2's local
shards equals FSDP2's own unsharded parameters; our ``foreach_reduce`` of the
replica's per-rank unsharded gradients equals FSDP2's sharded ``.grad``.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

import fsdp_traceable
from fsdp_traceable import (
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
    make_shard_info,
)
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.collectives.collectives_reference import assert_all_bitwise_equal

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

WORLD_SIZES = (2, 3)
POLICIES = {
    "fp32": MixedPrecisionPolicy(),
    "bf16_params_fp32_reduce": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32
    ),
}
PATHS = ("eager", "traced")


class SmallNet(nn.Module):
    """Weights (7, 6) [sharded on dim 1], (5, 7), (1, 5); biases (7,), (5,), (1,)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 7)
        self.mid = nn.Linear(7, 5)
        self.out = nn.Linear(5, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(torch.relu(self.inp(x)))))


def shard_placement(param: nn.Parameter) -> Shard:
    """``Shard(1)`` for the input weight (6 columns: divisible by 2 and 3)."""
    return Shard(1) if param.shape == (7, 6) else Shard(0)


def _infos(fsdp_params: list, world_size: int, rank: int) -> list:
    return [
        make_shard_info(
            fp._orig_size, world_size, rank, shard_dim=fp.fsdp_placement.dim,
            orig_dtype=fp.orig_dtype, param_dtype=fp.param_dtype, reduce_dtype=fp.reduce_dtype,
        )
        for fp in fsdp_params
    ]


def _run_policy(rank: int, world_size: int, policy: MixedPrecisionPolicy) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (world_size,))
    group = mesh.get_group()
    torch.manual_seed(0)
    model = SmallNet()
    replica = copy.deepcopy(model)
    fully_shard(model, mesh=mesh, mp_policy=policy, shard_placement_fn=shard_placement)
    fsdp_params = model._get_fsdp_state()._fsdp_param_group.fsdp_params
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(fp.sharded_param)] for fp in fsdp_params]

    model.unshard()  # also runs FSDP2's lazy init, which sets the dtypes
    fsdp_unsharded = [fp.unsharded_param.detach().clone() for fp in fsdp_params]
    model.reshard()
    infos = _infos(fsdp_params, world_size, rank)
    metadata = {
        "fsdp2": [(fp.sharded_size, fp.padded_sharded_param_size,
                   tuple(fp.contiguous_sharded_stride)) for fp in fsdp_params],
        "ours": [(i.sharded_size, i.padded_sharded_size, i.contiguous_sharded_stride)
                 for i in infos],
    }
    local_shards = [fp.sharded_param.detach().to_local() for fp in fsdp_params]

    inputs = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank))
    model(inputs).sum().backward()
    fsdp_grads = [fp.sharded_param.grad.to_local().clone() for fp in fsdp_params]

    # The replica computes what FSDP2's unsharded parameters see: the same forward in
    # param_dtype on the same per-rank inputs.
    compute_dtype = policy.param_dtype or torch.float32
    replica = replica.to(compute_dtype)
    replica(inputs.to(compute_dtype)).sum().backward()
    replica_grads = dict(replica.named_parameters())
    unsharded_grads = [replica_grads[name].grad for name in order]

    ours: dict[str, dict[str, list[torch.Tensor]]] = {}
    for path in PATHS:
        with fsdp_traceable.config.patch(collectives_path=path):
            gathered = foreach_all_gather_copy_out(foreach_all_gather(local_shards, infos, group))
            reduced = foreach_reduce(unsharded_grads, infos, group).sharded_grads
        ours[path] = {"unsharded": gathered, "sharded_grads": reduced}
    return {
        "order": order,
        "metadata": metadata,
        "fsdp2": {"unsharded": fsdp_unsharded, "sharded_grads": fsdp_grads},
        "ours": ours,
        "dtypes": [(fp.param_dtype, fp.reduce_dtype, fp.orig_dtype) for fp in fsdp_params],
    }


def run_parity(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Rank body: every policy of :data:`POLICIES`, each on a fresh model."""
    results = {name: _run_policy(rank, world_size, policy) for name, policy in POLICIES.items()}
    dist.barrier()
    return results


@functools.cache
def parity_results(world_size: int) -> list[dict[str, Any]]:
    return run_on_local_ranks(run_parity, world_size, timeout_s=300)


CASES = [(w, p) for w in WORLD_SIZES for p in POLICIES]


@pytest.mark.parametrize("world_size,policy", CASES)
def test_shard_metadata_matches_fsdp2(world_size: int, policy: str) -> None:
    for rank, result in enumerate(parity_results(world_size)):
        res = result[policy]
        assert res["metadata"]["ours"] == res["metadata"]["fsdp2"], f"rank {rank}"
        assert res["order"] == ["inp.weight", "inp.bias", "mid.weight", "mid.bias",
                                "out.weight", "out.bias"]


@pytest.mark.parametrize("world_size,policy", CASES)
def test_all_gather_matches_fsdp2_unshard(world_size: int, policy: str) -> None:
    for rank, result in enumerate(parity_results(world_size)):
        res = result[policy]
        expected_dtype = POLICIES[policy].param_dtype or torch.float32
        assert {t.dtype for t in res["fsdp2"]["unsharded"]} == {expected_dtype}
        for path in PATHS:
            assert_all_bitwise_equal(res["ours"][path]["unsharded"], res["fsdp2"]["unsharded"],
                                     f"rank {rank} {path}")


@pytest.mark.parametrize("world_size,policy", CASES)
def test_reduce_matches_fsdp2_grads(world_size: int, policy: str) -> None:
    for rank, result in enumerate(parity_results(world_size)):
        res = result[policy]
        mp = POLICIES[policy]
        assert res["dtypes"][0] == (mp.param_dtype, mp.reduce_dtype, torch.float32)
        for path in PATHS:
            assert_all_bitwise_equal(res["ours"][path]["sharded_grads"],
                                     res["fsdp2"]["sharded_grads"], f"rank {rank} {path}")
        if rank == world_size - 1:
            # the last rank holds no row of the (1, 5) weight: the check covers empty shards
            assert res["fsdp2"]["sharded_grads"][4].numel() == 0
