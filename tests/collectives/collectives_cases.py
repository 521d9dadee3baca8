"""The cases of ``test_collectives`` and the body that runs them on gloo ranks.

One spawned run per topology runs every case through the eager path, the traced
path (eager functional collectives) and, for a few cases, ``torch.compile``; it
returns the raw outputs, which the test process checks against
:mod:`tests.collectives_reference`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch._prims_common import make_contiguous_strides_for
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_traceable
from fsdp_traceable import (
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
)
from tests.collectives.collectives_reference import (
    BF16,
    FP16,
    FP32,
    ParamSpec,
    bucket,
    full_params,
    make_infos,
    rank_grads,
    shard_all,
)

SEED = 11
PATHS = ("eager", "traced")
# A constant fp16 gradient whose plain sum over the data-parallel ranks overflows
# (> 65504) while the pre-divided sum does not: proves the pre-divide happened.
FP16_GUARD = {2: 40000.0, 4: 30000.0}


@dataclass(frozen=True)
class Topology:
    """A process layout: ``replicate`` groups of ``shard`` ranks (HSDP when both > 1)."""

    shard: int
    replicate: int = 1
    compile_gather: tuple[str, ...] = ()
    compile_reduce: tuple[str, ...] = ()

    @property
    def world_size(self) -> int:
        return self.shard * self.replicate

    @property
    def hsdp(self) -> bool:
        return self.replicate > 1


@dataclass(frozen=True)
class ReduceCase:
    """One ``foreach_reduce`` scenario.

    ``kind`` picks the driver: ``plain`` (one call), ``hook`` (an all-reduce hook that
    doubles its input), ``offload`` (CPU-offloaded infos), ``accumulate`` /
    ``accumulate_dtensor`` (two calls into ``.grad`` of plain / DTensor parameters
    with a post-accumulate-grad hook), ``partial`` (HSDP: two calls without the
    all-reduce, then a final one with it).
    """

    specs: tuple[ParamSpec, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    max_int: int = 64
    max_exp: int = 0
    kind: str = "plain"
    fp16_guard: bool = False
    hsdp_only: bool = False


# Ranges whose four-rank sums are exact in fp32 but not in bf16.
_FP32_DATA = {"max_int": 1024, "max_exp": 8}
_WIDE_BF16_DATA = {"max_int": 64, "max_exp": 8}

GATHER_CASES: dict[str, tuple[ParamSpec, ...]] = {
    "fp32": bucket(FP32),
    "bf16": bucket(BF16),
    "fp16": bucket(FP16),
    "mixed_dtypes": bucket([FP32, BF16, FP16]),
    "fp32_cast_to_bf16": bucket(FP32, param_dtype=BF16),
}

REDUCE_CASES: dict[str, ReduceCase] = {
    "avg_fp32": ReduceCase(bucket(FP32), **_FP32_DATA),
    "avg_bf16": ReduceCase(bucket(BF16)),
    "fp16_pre_post_divide": ReduceCase(bucket(FP16) + (ParamSpec((4,), 0, FP16),),
                                       fp16_guard=True),
    "fp16_divide_factor_3": ReduceCase(bucket(FP16), {"gradient_divide_factor": 3.0}),
    "divide_factor_2": ReduceCase(bucket(FP32), {"gradient_divide_factor": 2.0}, **_FP32_DATA),
    "divide_factor_3": ReduceCase(bucket(FP32), {"gradient_divide_factor": 3.0}, **_FP32_DATA),
    "reduce_op_sum": ReduceCase(bucket(FP32), {"reduce_op": "sum"}, **_FP32_DATA),
    "force_sum_reduction": ReduceCase(bucket(FP32), {"force_sum_reduction": True}, **_FP32_DATA),
    "bf16_grads_fp32_reduce": ReduceCase(bucket(FP32, BF16, FP32), **_WIDE_BF16_DATA),
    "bf16_orig_fp32_reduce_divide_3": ReduceCase(
        bucket(BF16, reduce_dtype=FP32), {"gradient_divide_factor": 3.0}, **_WIDE_BF16_DATA),
    "all_reduce_hook": ReduceCase(bucket(FP32), kind="hook", **_FP32_DATA),
    "offload_to_cpu": ReduceCase(bucket(FP32), kind="offload", **_FP32_DATA),
    "accumulate_plain": ReduceCase(bucket(FP32), kind="accumulate", **_FP32_DATA),
    "accumulate_dtensor": ReduceCase(bucket(FP32), kind="accumulate_dtensor", **_FP32_DATA),
    "accumulate_dtensor_bf16": ReduceCase(bucket(BF16), kind="accumulate_dtensor"),
    "hsdp_partial_reduce": ReduceCase(bucket(FP32), kind="partial", hsdp_only=True,
                                      **_FP32_DATA),
}

TOPOLOGIES: dict[str, Topology] = {
    "world2": Topology(2, compile_gather=("mixed_dtypes",),
                       compile_reduce=("avg_fp32", "fp16_pre_post_divide")),
    "world4": Topology(4),
    "hsdp2x2": Topology(2, 2, compile_reduce=("avg_fp32",)),
}
# Topologies of one world size share a spawned run: starting ranks costs more than
# running the cases.
RUNS: dict[int, tuple[str, ...]] = {2: ("world2",), 4: ("world4", "hsdp2x2")}


def reduce_cases_for(topology: Topology) -> list[str]:
    """The reduce cases that apply to ``topology``."""
    return [n for n, c in REDUCE_CASES.items() if topology.hsdp or not c.hsdp_only]


def case_grads(
    case: ReduceCase, seed: int, rank: int, data_parallel_size: int
) -> list[torch.Tensor]:
    """Global rank ``rank``'s unsharded gradients for ``case`` (also used by the reference).

    Args:
        case: the reduce case.
        seed: the microbatch seed.
        rank: the global rank.
        data_parallel_size: all ranks taking part in the reduction (picks the fp16 guard).

    Returns:
        One gradient per parameter of ``case.specs``, in its param dtype.
    """
    grads = rank_grads(case.specs, seed, rank, max_int=case.max_int, max_exp=case.max_exp)
    if case.fp16_guard:
        grads[-1] = torch.full_like(grads[-1], FP16_GUARD[data_parallel_size])
    return grads


class _Groups:
    """The process groups and mesh of one topology on this rank."""

    def __init__(self, topology: Topology) -> None:
        if topology.hsdp:
            self.mesh: DeviceMesh = init_device_mesh(
                "cpu", (topology.replicate, topology.shard), mesh_dim_names=("replicate", "shard")
            )
            self.shard = self.mesh.get_group("shard")
            self.replicate: dist.ProcessGroup | None = self.mesh.get_group("replicate")
        else:
            self.mesh = init_device_mesh("cpu", (topology.shard,))
            self.shard = self.mesh.get_group()
            self.replicate = None
        self.shard_rank = self.shard.rank()

    def placements(self, shard_dim: int) -> tuple:
        if self.replicate is None:
            return (Shard(shard_dim),)
        return (Replicate(), Shard(shard_dim))


def _gather(specs: tuple[ParamSpec, ...], groups: _Groups, shard_size: int) -> Callable:
    infos = make_infos(specs, shard_size, groups.shard_rank)
    group = groups.shard

    def round_trip(shards: list[torch.Tensor]) -> list[torch.Tensor]:
        return foreach_all_gather_copy_out(foreach_all_gather(shards, infos, group))

    return round_trip


def _reduce_fn(case: ReduceCase, groups: _Groups, shard_size: int, **extra: Any) -> Callable:
    infos = make_infos(case.specs, shard_size, groups.shard_rank,
                       offload_to_cpu=case.kind == "offload")
    shard, replicate, kwargs = groups.shard, groups.replicate, {**case.kwargs, **extra}

    def reduce(grads: list[torch.Tensor]) -> list[torch.Tensor]:
        return foreach_reduce(grads, infos, shard, all_reduce_group=replicate,
                              **kwargs).sharded_grads

    return reduce


def _sharded_params(case: ReduceCase, groups: _Groups, shard_size: int) -> list[torch.Tensor]:
    params = []
    for info, spec in zip(make_infos(case.specs, shard_size, groups.shard_rank), case.specs):
        local = torch.zeros(info.sharded_size, dtype=spec.orig_dtype)
        if case.kind == "accumulate_dtensor":
            local = DTensor.from_local(
                local, groups.mesh, groups.placements(spec.shard_dim), run_check=False,
                shape=info.global_size, stride=make_contiguous_strides_for(info.global_size),
            )
        params.append(torch.nn.Parameter(local))
    return params


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _run_reduce(case: ReduceCase, groups: _Groups, topology: Topology, rank: int) -> dict:
    dp = topology.world_size
    grads = case_grads(case, SEED, rank, dp)
    if case.kind in ("plain", "offload"):
        return {"grads": _reduce_fn(case, groups, topology.shard)(grads)}
    if case.kind == "hook":
        seen: list[torch.Tensor] = []

        def double(flat: torch.Tensor) -> None:
            seen.append(flat.clone())
            flat.mul_(2)

        out = _reduce_fn(case, groups, topology.shard, all_reduce_hook=double)(grads)
        return {"grads": out, "hook_inputs": seen}
    infos = make_infos(case.specs, topology.shard, groups.shard_rank)
    if case.kind == "partial":
        common = {"all_reduce_group": groups.replicate, **case.kwargs}
        first = foreach_reduce(grads, infos, groups.shard, all_reduce_grads=False, **common)
        second = foreach_reduce(case_grads(case, SEED + 1, rank, dp), infos, groups.shard,
                                all_reduce_grads=False,
                                partial_reduce_output=first.partial_reduce_output, **common)
        final = foreach_reduce(case_grads(case, SEED + 2, rank, dp), infos, groups.shard,
                               partial_reduce_output=second.partial_reduce_output, **common)
        return {
            "skipped_grads": [first.sharded_grads, second.sharded_grads],
            "partials": [first.partial_reduce_output, second.partial_reduce_output],
            "final_partial": final.partial_reduce_output,
            "grads": final.sharded_grads,
        }
    # accumulate / accumulate_dtensor: two reductions into the same parameters.
    params = _sharded_params(case, groups, topology.shard)
    hook_calls: list[tuple[int, torch.Tensor]] = []
    for index, param in enumerate(params):
        param.register_post_accumulate_grad_hook(
            lambda p, i=index: hook_calls.append((i, _local(p.grad).clone()))
        )
    after = []
    for seed in (SEED, SEED + 1):
        foreach_reduce(case_grads(case, seed, rank, dp), infos, groups.shard,
                       all_reduce_group=groups.replicate, accumulate_into=params, **case.kwargs)
        after.append([_local(p.grad).clone() for p in params])
    return {
        "grads_after_each_call": after,
        "hook_calls": hook_calls,
        "grad_types": [type(p.grad).__name__ for p in params],
        "grad_placements": [str(getattr(p.grad, "placements", None)) for p in params],
        "grad_shapes": [tuple(p.grad.shape) for p in params],
    }


def run_topologies(rank: int, world_size: int) -> dict[str, dict[str, Any]]:
    """Rank body: :func:`run_topology` for each topology of ``RUNS[world_size]``."""
    return {name: run_topology(rank, world_size, name) for name in RUNS[world_size]}


def run_topology(rank: int, world_size: int, topology_name: str) -> dict[str, Any]:
    """Every gather and reduce case of one topology on both paths, a few compiled.

    Returns:
        ``{"gather": {case: {path: outputs}}, "reduce": {case: {path: outputs}}}``
        where path is ``eager``, ``traced`` or ``compiled``.
    """
    topology = TOPOLOGIES[topology_name]
    assert world_size == topology.world_size
    groups = _Groups(topology)
    results: dict[str, dict] = {"gather": {}, "reduce": {}}
    for name, specs in GATHER_CASES.items():
        shards = shard_all(full_params(specs, SEED), specs, topology.shard, groups.shard_rank)
        round_trip = _gather(specs, groups, topology.shard)
        per_path = {}
        for path in PATHS:
            with fsdp_traceable.config.patch(collectives_path=path):
                per_path[path] = round_trip(shards)
        if name in topology.compile_gather:
            per_path["compiled"] = torch.compile(round_trip, fullgraph=True)(shards)
        results["gather"][name] = per_path
    for name in reduce_cases_for(topology):
        case = REDUCE_CASES[name]
        per_path = {}
        for path in PATHS:
            with fsdp_traceable.config.patch(collectives_path=path):
                per_path[path] = _run_reduce(case, groups, topology, rank)
        if name in topology.compile_reduce:
            reduce = torch.compile(_reduce_fn(case, groups, topology.shard), fullgraph=True)
            per_path["compiled"] = {"grads": reduce(case_grads(case, SEED, rank,
                                                               topology.world_size))}
        results["reduce"][name] = per_path
    return results
