"""TP + FSDP on a (dp=2, tp=2) mesh of 4 gloo ranks, and expert parallel + FSDP on a
MoE model (``tests/fsdp/features/expert_parallel_cases.py``), compiled whole: our model under
``torch.compile(fullgraph=True)`` with compiled autograd (``aot_eager``: Dynamo,
AOTAutograd and compiled autograd, without Inductor's code generation) against torch's
FSDP2 eager, 3 AdamW steps; the eager comparison is ``tests/fsdp/features/test_tensor_parallel.py``."""

from __future__ import annotations

import pytest
import torch

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.features import tensor_parallel_cases


def _assert_close(theirs: dict, ours: dict, what: str) -> None:
    assert list(theirs) == list(ours), what
    for name, (their_layout, their_local) in theirs.items():
        our_layout, our_local = ours[name]
        assert our_layout == their_layout, f"{what} {name}: {our_layout} vs {their_layout}"
        torch.testing.assert_close(our_local, their_local, rtol=1e-5, atol=1e-5,
                                   msg=f"{what} {name}")


@pytest.mark.gloo
def test_compiled_tp_fsdp_trains_like_fsdp2_eager_without_graph_breaks():
    results = run_on_local_ranks(tensor_parallel_cases.compiled_parity, 4, "aot_eager",
                                 timeout_s=600)
    for rank, result in enumerate(results):
        theirs, ours = result["theirs"], result["ours"]
        assert result["graph_breaks"] == 0, f"rank {rank}"
        # One forward frame (Dynamo also compiles compiled autograd's captured graph).
        assert result["frames"].count("loss") == 1, f"rank {rank}: {result['frames']}"
        assert result["recompiles"] == 0, f"rank {rank}"
        assert result["captures"] == 1, f"rank {rank}: compiled autograd captured again"
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=1e-5, atol=1e-5)
        _assert_close(theirs["grads"], ours["grads"], f"rank {rank} grad")
        _assert_close(theirs["params"], ours["params"], f"rank {rank} param")
        assert ours["state_dict"] == theirs["state_dict"], f"rank {rank}"
        moe = result["moe"]  # expert parallel: experts Shard(1) on their own mesh
        assert (moe["graph_breaks"], moe["recompiles"]) == (0, 0), f"rank {rank} MoE"
        torch.testing.assert_close(moe["ours"]["losses"], moe["theirs"]["losses"],
                                   rtol=1e-5, atol=1e-5)
        _assert_close(moe["theirs"]["grads"], moe["ours"]["grads"], f"rank {rank} MoE grad")
        _assert_close(moe["theirs"]["params"], moe["ours"]["params"], f"rank {rank} MoE param")


def test_dp_mesh_dims_raises_under_compile() -> None:
    """``dp_mesh_dims`` runs eagerly only (see ``fsdp/features/tensor_parallel.py``); compiled, the
    first forward says so (one process, a fake (2, 2) world)."""
    dims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)
    if dims is None:
        pytest.skip("torch < 2.12 has no dp_mesh_dims")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    import fsdp_traceable
    from fsdp_traceable.introspection.fake_world import fake_process_group

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = tensor_parallel_cases.SpmdMLP().distribute(mesh)
        fsdp_traceable.fully_shard(model, mesh=mesh, dp_mesh_dims=dims(shard="dp"))
        x = DTensor.from_local(torch.randn(4, tensor_parallel_cases.DIM), mesh,
                               (Shard(0), Replicate()))
        with pytest.raises(Exception, match="dp_mesh_dims=...\\) runs eagerly only"):
            torch.compile(model, backend="aot_eager", fullgraph=True)(x)
