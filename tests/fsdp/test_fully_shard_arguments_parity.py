"""fully_shard's arguments against torch's FSDP2 on 2 and 3 gloo ranks, uneven shards.

A list of modules as one group (torchtitan's ``[norm, output]``), ``reshard_after_forward``
True on the root, ``CPUOffloadPolicy``, ``ignored_params``, float64 parameters and a
``ShardPlacementResult``: eager bitwise (losses, this rank's first gradients and shards,
full parameters after 3 AdamW steps); the list group and the resharding root also
compiled with compiled autograd, within 1e-5 (2 ranks, AOTAutograd's eager backend: the
arguments change only what is traced). On a CPU mesh the offload's host copies are
same-device no-ops; ``tests/gpu`` runs them on CUDA, eager and compiled.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn

from fsdp_traceable import fully_shard
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, case_results, run_cases

EAGER_CASES = ("module_list_group", "root_reshard_true", "cpu_offload", "ignored_params",
               "float64_params", "float64_after_fully_shard", "shard_placement_result",
               "chunked_head_after_group_forward")
# Compiled case: its mode (the compile dominates the test's time).
# Not CPU offload: on a CPU mesh its host copies are no-ops, so compiled it would trace
# nothing the other cases do not; tests/gpu/test_cuda.py compiles it on CUDA.
COMPILED_MODES = {"module_list_group": "compile-ca-aot-eager",
                  "root_reshard_true": "compile-ca-aot-eager"}
COMPILED_CASES = tuple(COMPILED_MODES)


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict[str, Any]]:
    cases = [(f"{name}_eager", getattr(parity_cases, name), ("eager",)) for name in EAGER_CASES]
    if request.param == 2:  # compiled: 2 ranks only
        cases += [(f"{name}_compile-ca", getattr(parity_cases, name), (mode,))
                  for name, mode in COMPILED_MODES.items()]
    return run_on_local_ranks(run_cases, request.param, cases, timeout_s=600)



def _assert_close(theirs: list, ours: list, what: str, atol: float) -> None:
    for i, (a, b) in enumerate(zip(theirs, ours, strict=True)):
        if a is None or b is None:
            assert a is None and b is None, f"{what}[{i}]: one is None"
            continue
        torch.testing.assert_close(b, a, rtol=0, atol=atol, msg=f"{what}[{i}]")


@pytest.mark.gloo
@pytest.mark.parametrize("name", EAGER_CASES)
def test_eager_matches_fsdp2_bitwise(ranks, name: str):
    for result in case_results(ranks, f"{name}_eager"):
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients")
        assert_bitwise(theirs["locals"], ours["locals"], "local shards")
        assert_bitwise(theirs["params"], ours["params"], "full parameters")
        if name == "cpu_offload":
            assert result["offload_flags"] == [True]
        if name == "ignored_params":
            assert result["ignored_types"] == ["Parameter", "Parameter"]  # not DTensors
        if name == "shard_placement_result":
            assert any("Shard(dim=1)" in p for p in result["placements"])


@pytest.mark.gloo
@pytest.mark.parametrize("name", COMPILED_CASES)
def test_compiled_autograd_within_1e5_of_fsdp2(ranks, name: str):
    if len(ranks) != 2:
        pytest.skip("compiled cases run on 2 ranks")
    for result in case_results(ranks, f"{name}_compile-ca"):
        theirs, ours = result["theirs"], result["ours"]
        _assert_close(theirs["losses"], ours["losses"], "losses", 1e-5)
        _assert_close(theirs["params"], ours["params"], "parameters", 1e-5)


def test_shard_placement_result_on_another_mesh_raises() -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import (
        FSDPMeshInfo,
        ShardPlacementResult,
    )
    from torch.distributed.tensor import Shard

    with fake_process_group(4, reset_dynamo=False):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (4,))
        other = torch.distributed.device_mesh.init_device_mesh("cpu", (4,))
        info = FSDPMeshInfo(other, shard_mesh_dim=0)
        with pytest.raises(NotImplementedError, match="ShardPlacementResult.*'weight'"):
            fully_shard(nn.Linear(4, 4), mesh=mesh,
                        shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), info))
