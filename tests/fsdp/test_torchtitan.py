"""torchtitan's own Llama 3 ``parallelize_llama`` (TP with sequence parallel, then
FSDP) on a (dp_shard=2, tp=2) mesh of 4 gloo ranks, with our ``fully_shard`` in place of
torch's, against the same with torch's FSDP2: losses, first gradients, final shards and
every layout bit for bit (bf16 parameters, fp32 reduction), eagerly (also with
torchtitan's full and selective activation checkpointing), with each block
compiled by torchtitan's ``apply_compile``, and with the whole training step compiled as
one graph (torch 2.12+); the compiled ones on AOTAutograd's eager backend. Body and the few CPU adaptations
(the same on both sides) in ``torchtitan_cases``."""

from __future__ import annotations

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors
from tests.fsdp import torchtitan_cases
from tests.fsdp.features.test_tensor_parallel import _assert_same


@pytest.mark.gloo
def test_torchtitan_llama3_parallelize_trains_like_fsdp2() -> None:
    results = run_on_local_ranks(torchtitan_cases.parity, 4, timeout_s=300)
    for rank, result in enumerate(results):
        assert ("whole_step" in result) == dynamo_traces_backward_into_dtensors()
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        _assert_same(theirs["grads"], ours["grads"], f"rank {rank} grad")
        _assert_same(theirs["params"], ours["params"], f"rank {rank} param")
        assert ours["state_dict"] == theirs["state_dict"], f"rank {rank}"
        for ac in ("full", "selective"):  # torchtitan's apply_ac on every block, eager
            theirs_ac, ours_ac = result[f"theirs_ac_{ac}"], result[f"ours_ac_{ac}"]
            assert ours_ac["losses"] == theirs_ac["losses"], f"rank {rank} {ac} AC"
            _assert_same(theirs_ac["grads"], ours_ac["grads"], f"rank {rank} {ac} AC grad")
            _assert_same(theirs_ac["params"], ours_ac["params"], f"rank {rank} {ac} AC param")
        # torchtitan's per-block compile (its apply_compile, aot_eager), before our fully_shard.
        blocks = result["blocks_compiled"]
        assert (blocks["graphs"], blocks["graph_breaks"]) == (2, {}), f"rank {rank}"
        assert blocks["losses"] == theirs["losses"], f"rank {rank} blocks compiled"
        _assert_same(theirs["grads"], blocks["grads"], f"rank {rank} blocks-compiled grad")
        _assert_same(theirs["params"], blocks["params"], f"rank {rank} blocks-compiled param")
        if "whole_step" in result:  # compile_step: bitwise too (aot_eager, no cast differs)
            step = result["whole_step"]
            assert (step["frames"], step["graph_breaks"]) == (1, {}), f"rank {rank}"
            assert step["losses"] == theirs["losses"], f"rank {rank} whole step"
            _assert_same(theirs["grads"], step["grads"], f"rank {rank} whole-step grad")
            _assert_same(theirs["params"], step["params"], f"rank {rank} whole-step param")
    # tp in every parameter's mesh: the TP plan was applied before FSDP's sharding.
    layouts = {layout for layout, _ in results[0]["ours"]["params"].values()}
    assert all("tp" in mesh_dims and "fsdp" in mesh_dims for mesh_dims, _ in layouts), layouts
