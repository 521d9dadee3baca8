"""foreach_all_gather / copy-out / foreach_reduce on real gloo ranks vs reference math.

One spawned run per topology (2 ranks, 4 ranks, a 2x2 HSDP mesh) runs every case of
:mod:`tests.collectives_cases` on the eager and traced paths (a few under
``torch.compile(fullgraph=True)`` too); each test below checks one case on every
rank against single-process reference math, bitwise, and the paths against each other.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.collectives.collectives_cases import (
    FP16_GUARD,
    GATHER_CASES,
    PATHS,
    REDUCE_CASES,
    SEED,
    TOPOLOGIES,
    ReduceCase,
    Topology,
    case_grads,
    reduce_cases_for,
    run_topologies,
)
from tests.collectives.collectives_reference import (
    FP16,
    assert_all_bitwise_equal,
    assert_bitwise_equal,
    chunk_shard,
    divide,
    full_params,
    padded_flat,
)

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


@functools.cache
def run_results(world_size: int) -> list[dict[str, Any]]:
    """Each rank's outputs of the topologies with ``world_size`` ranks (one spawned run)."""
    return run_on_local_ranks(run_topologies, world_size, timeout_s=300)


def topology_results(name: str) -> list[dict[str, Any]]:
    """Each rank's outputs for topology ``name``."""
    return [per_rank[name] for per_rank in run_results(TOPOLOGIES[name].world_size)]


def assert_paths_bitwise_equal(per_path: dict[str, Any], what: str) -> None:
    """Every path's outputs (nested lists/dicts of tensors) are bitwise equal to eager's."""
    for path, outputs in per_path.items():
        _assert_same(outputs, per_path["eager"], f"{what}: {path} vs eager")


def _assert_same(actual: Any, expected: Any, what: str) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{what}: got {type(actual)}"
        assert_bitwise_equal(actual, expected, what)
    elif isinstance(expected, dict):
        # the compiled path returns only the sharded gradients
        assert actual.keys() <= expected.keys(), f"{what}: keys {sorted(actual)}"
        for key in actual:
            _assert_same(actual[key], expected[key], f"{what}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{what}: length {len(actual)} != {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            _assert_same(a, e, f"{what}[{i}]")
    else:
        assert actual == expected, f"{what}: {actual!r} != {expected!r}"


def expected_reduction(case: ReduceCase, topology: Topology, seed: int) -> list[torch.Tensor]:
    """The unsharded reduced gradients over all data-parallel ranks, in the orig dtype."""
    dp = topology.world_size
    per_rank = [case_grads(case, seed, r, dp) for r in range(dp)]
    sums = [sum(g[i].double() for g in per_rank) for i in range(len(case.specs))]
    kwargs = case.kwargs
    if kwargs.get("reduce_op") == "sum":
        return divide(sums, case.specs, 1)
    factor = kwargs.get("gradient_divide_factor")
    if factor is not None and case.specs[0].reduction_dtype == FP16:
        # FSDP2's fp16 split of a factor of 3: pre-divide by 2 (exact here), sum,
        # post-divide by 1.5 in fp16.
        assert factor == 3.0
        return [(total / 2).to(FP16) / 1.5 for total in sums]
    return divide(sums, case.specs, factor or dp)


def shard_grads(fulls: list[torch.Tensor], case: ReduceCase, topology: Topology,
                rank: int) -> list[torch.Tensor]:
    return [chunk_shard(f, s.shard_dim, topology.shard, rank % topology.shard)
            for f, s in zip(fulls, case.specs)]


GATHER_PARAMS = [(t, c) for t in TOPOLOGIES for c in GATHER_CASES]
REDUCE_PARAMS = [(t, c) for t, topo in TOPOLOGIES.items() for c in reduce_cases_for(topo)]


@pytest.mark.parametrize("topology_name,case_name", GATHER_PARAMS)
def test_all_gather_round_trip(topology_name: str, case_name: str) -> None:
    specs = GATHER_CASES[case_name]
    expected = [f.to(s.gather_dtype) for f, s in zip(full_params(specs, SEED), specs)]
    for rank, result in enumerate(topology_results(topology_name)):
        per_path = result["gather"][case_name]
        for path, outputs in per_path.items():
            assert_all_bitwise_equal(outputs, expected, f"rank {rank} {path}")
        assert_paths_bitwise_equal(per_path, f"rank {rank}")


@pytest.mark.parametrize("topology_name,case_name", REDUCE_PARAMS)
def test_foreach_reduce(topology_name: str, case_name: str) -> None:
    topology, case = TOPOLOGIES[topology_name], REDUCE_CASES[case_name]
    expected_full = expected_reduction(case, topology, SEED)
    for rank, result in enumerate(topology_results(topology_name)):
        per_path = result["reduce"][case_name]
        assert set(per_path) >= set(PATHS)
        assert_paths_bitwise_equal(per_path, f"rank {rank}")
        expected = shard_grads(expected_full, case, topology, rank)
        for path, out in per_path.items():
            what = f"rank {rank} {path}"
            if case.kind in ("accumulate", "accumulate_dtensor"):
                check_accumulate(out, case, topology, rank, expected, what)
            elif case.kind == "partial":
                check_partial(out, case, topology, rank, what)
            elif case.kind == "hook":
                flat = padded_flat(expected, case.specs, topology.shard)
                assert_all_bitwise_equal(out["hook_inputs"], [flat], f"{what} hook input")
                assert_all_bitwise_equal(out["grads"], [2 * g for g in expected], what)
            else:
                assert_all_bitwise_equal(out["grads"], expected, what)


def check_accumulate(out: dict, case: ReduceCase, topology: Topology, rank: int,
                     first: list[torch.Tensor], what: str) -> None:
    second = shard_grads(expected_reduction(case, topology, SEED + 1), case, topology, rank)
    total = [a + b for a, b in zip(first, second)]
    assert_all_bitwise_equal(out["grads_after_each_call"][0], first, f"{what} after call 1")
    assert_all_bitwise_equal(out["grads_after_each_call"][1], total, f"{what} after call 2")
    n = len(case.specs)
    assert [i for i, _ in out["hook_calls"]] == list(range(n)) * 2, f"{what}: hook calls"
    assert_all_bitwise_equal([g for _, g in out["hook_calls"]], first + total, f"{what} hooks")
    if case.kind == "accumulate":
        assert out["grad_types"] == ["Tensor"] * n
        assert out["grad_shapes"] == [tuple(g.shape) for g in first]
        return
    assert out["grad_types"] == ["DTensor"] * n
    assert out["grad_shapes"] == [s.global_size for s in case.specs]
    shard = [f"Shard(dim={s.shard_dim})" for s in case.specs]
    want = [f"({p},)" if not topology.hsdp else f"(Replicate(), {p})" for p in shard]
    assert out["grad_placements"] == want, what


def check_partial(out: dict, case: ReduceCase, topology: Topology, rank: int,
                  what: str) -> None:
    """Two skipped all-reduces accumulate the shard-group averages; the final call
    adds its own, all-reduces and averages over the replicas."""
    group_ranks = [r for r in range(topology.world_size)
                   if r // topology.shard == rank // topology.shard]
    partial = None
    for step in range(2):
        per_rank = [case_grads(case, SEED + step, r, topology.world_size) for r in group_ranks]
        sums = [sum(g[i].double() for g in per_rank) for i in range(len(case.specs))]
        shards = shard_grads(divide(sums, case.specs, topology.shard), case, topology, rank)
        flat = padded_flat(shards, case.specs, topology.shard)
        partial = flat if partial is None else partial + flat
        assert out["skipped_grads"][step] is None, what
        assert_bitwise_equal(out["partials"][step], partial, f"{what} partial {step}")
    assert out["final_partial"] is None, what
    fulls = [expected_reduction(case, topology, SEED + k) for k in range(3)]
    exact = [sum(f[i].double() for f in fulls).float() for i in range(len(case.specs))]
    expected = shard_grads(exact, case, topology, rank)
    assert_all_bitwise_equal(out["grads"], expected, f"{what} final")


@pytest.mark.parametrize("topology_name", list(TOPOLOGIES))
def test_compiled_paths_ran(topology_name: str) -> None:
    topology = TOPOLOGIES[topology_name]
    for result in topology_results(topology_name):
        for name in topology.compile_gather:
            assert "compiled" in result["gather"][name]
        for name in topology.compile_reduce:
            assert "compiled" in result["reduce"][name]


def test_reference_data_discriminates() -> None:
    """The data make the checks sharp: an fp16 sum without the pre-divide overflows, and
    the wide bf16 gradients reduced in bf16 would round (so fp32 reduction shows)."""
    for dp, value in FP16_GUARD.items():
        assert torch.isinf(torch.tensor(value, dtype=FP16) * dp)
        assert torch.isfinite(torch.tensor(value / 2, dtype=FP16) * dp)
    case = REDUCE_CASES["bf16_grads_fp32_reduce"]
    grads = [case_grads(case, SEED, r, 4) for r in range(4)]
    in_bf16 = grads[0][0] + grads[1][0] + grads[2][0] + grads[3][0]
    in_fp32 = sum(g[0].float() for g in grads)
    assert not torch.equal(in_bf16.float(), in_fp32)
