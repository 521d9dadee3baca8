"""TP + FSDP on a (dp=2, tp=2) mesh of 4 gloo ranks against torch's FSDP2: a torchtitan-
style plan, ``fully_shard`` per block and at the root, 3 AdamW steps eagerly (and 2 with
bf16 mixed precision, and 2 built on meta as torchtitan does); losses, first-step
gradients, final shards, parameter and ``state_dict()`` layouts bit for bit, and the TP
DTensors forward computes with; the same with ``dp_mesh_dims`` (torch 2.12+); FSDP2's
DCP checkpoint loads into ours; both on torchtitan's mesh for context parallelism
(``fully_shard`` on ``(dp_shard, cp)`` flattened into ``dp_shard_cp``); gradient-norm
clipping of the 2-D gradients; a MoE model with expert parallel as torchtitan shards it
(experts on ``dp_shard_mod_ep`` with ``Shard(1)`` or the default ``Shard(0)`` and
``set_gradient_divide_factor``, dense layers on the flattened dp mesh); inputs that
cannot be sharded are rejected by name before any collective."""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.features import tensor_parallel_cases


def _assert_same(theirs: dict, ours: dict, what: str) -> None:
    assert list(theirs) == list(ours), what
    for name, (their_layout, their_local) in theirs.items():
        our_layout, our_local = ours[name]
        assert our_layout == their_layout, f"{what} {name}: {our_layout} vs {their_layout}"
        assert torch.equal(our_local, their_local), f"{what} {name} differs"


@pytest.mark.gloo
def test_tp_fsdp_trains_like_fsdp2_and_rejects_what_it_cannot_shard(tmp_path):
    results = run_on_local_ranks(tensor_parallel_cases.eager_parity, 4, str(tmp_path),
                                 timeout_s=300)
    for rank, result in enumerate(results):
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        # Forward computes with the TP DTensors, on the TP mesh only.
        assert ours["compute_weights"] == theirs["compute_weights"] == {
            "w1": (("tp",), (Shard(0),)), "w2": (("tp",), (Shard(1),))}
        _assert_same(theirs["grads"], ours["grads"], f"rank {rank} grad")
        _assert_same(theirs["params"], ours["params"], f"rank {rank} param")
        assert ours["state_dict"] == theirs["state_dict"], f"rank {rank}"
        _assert_same(theirs["params"], result["loaded"], f"rank {rank} FSDP2 checkpoint")
        for case in ("bf16", "meta", "dp_shard_cp"):
            pair = result[case]
            assert pair["ours"]["losses"] == pair["theirs"]["losses"], f"rank {rank} {case}"
            _assert_same(pair["theirs"]["grads"], pair["ours"]["grads"], f"rank {rank} {case} grad")
            _assert_same(pair["theirs"]["params"], pair["ours"]["params"], f"rank {rank} {case}")
        # clip_grad_norm_ on the 2-D gradients: the norm reduced over both mesh dims.
        clip = result["clip"]
        assert clip["ours"]["total_norm"] > 0.05  # the clip is not vacuous
        assert torch.equal(clip["ours"]["total_norm"], clip["theirs"]["total_norm"])
        assert clip["ours"]["placements"] == clip["theirs"]["placements"]
        assert clip["ours"]["all_reduces"] == clip["theirs"]["all_reduces"] == 2
        _assert_same(clip["theirs"]["grads"], clip["ours"]["grads"], f"rank {rank} clipped grad")
        errors = result["errors"]
        assert errors["other_root"][0] == "ValueError" and "'weight'" in errors["other_root"][1]
        assert errors["overlap"][0] == "ValueError" and "already a DTensor" in errors["overlap"][1]
        assert errors["partial"][0] == "ValueError" and "Partial" in errors["partial"][1]
        if "spmd" in result:  # torch 2.12+: fully_shard(dp_mesh_dims=...)
            spmd = result["spmd"]
            assert spmd["ours"]["losses"] == spmd["theirs"]["losses"], f"rank {rank} spmd"
            _assert_same(spmd["theirs"]["grads"], spmd["ours"]["grads"], f"rank {rank} spmd grad")
            _assert_same(spmd["theirs"]["params"], spmd["ours"]["params"], f"rank {rank} spmd")
            assert errors["spmd_plain"][0] == "ValueError"
            assert "'weight' is a plain tensor" in errors["spmd_plain"][1]
            assert errors["spmd_sharded_on_dp"][0] == "ValueError"
            assert "on dp mesh dim 'dp'" in errors["spmd_sharded_on_dp"][1]
    # The layouts FSDP2 gives a colwise weight and a rowwise one (checked equal above).
    params = results[0]["ours"]["params"]
    colwise = params["layers.0.feed_forward.w1.weight"][0]
    rowwise = params["layers.0.feed_forward.w2.weight"][0]
    assert repr(colwise[1]) == repr((torch.distributed.tensor.placement_types._StridedShard(
        0, split_factor=2), torch.distributed.tensor.Shard(0)))
    assert rowwise == (("dp", "tp"), (torch.distributed.tensor.Shard(0),
                                      torch.distributed.tensor.Shard(1)))
    # Context parallelism's layout: every parameter sharded 4 ways on dp_shard_cp.
    for their_layout, _ in results[0]["dp_shard_cp"]["theirs"]["params"].values():
        assert their_layout == (("dp_shard_cp",), (Shard(0),))
    _check_moe([result["moe"] for result in results])


def _check_moe(results: list[dict]) -> None:
    """Expert parallel + FSDP (``expert_parallel_cases``) equals FSDP2 bit for bit, in
    FSDP2's layouts; ours rejects by name the experts FSDP2 cannot shard either."""
    strided = torch.distributed.tensor.placement_types._StridedShard(0, split_factor=2)
    for rank, result in enumerate(results):
        for experts_dim, experts_placement in ((1, Shard(1)), (0, strided)):
            theirs, ours = result[experts_dim]["theirs"], result[experts_dim]["ours"]
            what = f"rank {rank} MoE experts Shard({experts_dim})"
            assert ours["losses"] == theirs["losses"], what
            _assert_same(theirs["grads"], ours["grads"], f"{what} grad")
            _assert_same(theirs["params"], ours["params"], f"{what} param")
            for name, (layout, _) in ours["params"].items():
                expected = ((("dp_shard_mod_ep", "ep"), (experts_placement, Shard(0)))
                            if ".moe.experts." in name else (("dp",), (Shard(0),)))
                assert repr(layout) == repr(expected), f"{what} {name}: {layout}"
        errors = result["errors"]
        assert errors["experts_on_dp"][0] == "ValueError"
        assert "parameter 'w1'" in errors["experts_on_dp"][1]
        assert "dp_shard_mod_ep" in errors["experts_on_dp"][1]
        assert errors["uneven_shard_1"][0] == "NotImplementedError"  # FSDP2's type
        assert "parameter 'w1': Shard(1)" in errors["uneven_shard_1"][1]


@pytest.mark.gloo
def test_hsdp_tp_trains_like_fsdp2_on_eight_ranks() -> None:
    """HSDP + TP (3-D): (rep=2, shard=2, tp=2), 8 gloo ranks, 2 AdamW steps, bit for bit,
    ``Replicate()`` on ``rep`` before the shard and TP placements."""
    results = run_on_local_ranks(tensor_parallel_cases.hsdp_tp_parity, 8, timeout_s=300)
    for rank, result in enumerate(results):
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        _assert_same(theirs["grads"], ours["grads"], f"rank {rank} grad")
        _assert_same(theirs["params"], ours["params"], f"rank {rank} param")
    rowwise = results[0]["ours"]["params"]["layers.0.feed_forward.w2.weight"][0]
    assert rowwise == (("rep", "shard", "tp"), (Replicate(), Shard(0), Shard(1)))


class _Uneven(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = torch.nn.Linear(6, 10)
        self.down = torch.nn.Linear(10, 6)


def _on_mesh(param, mesh, placements) -> torch.nn.Parameter:
    from torch.distributed.tensor import distribute_tensor

    return torch.nn.Parameter(distribute_tensor(param.detach(), mesh, placements))


@pytest.mark.parametrize("rank", [0, 5, 6])
def test_hsdp_tp_layouts_match_fsdp2(rank: int) -> None:
    """HSDP + TP on a (2, 2, 2) fake mesh, uneven shards: FSDP2's mesh, placements and
    local shard shapes per parameter, ``Replicate()`` first for the HSDP dim; the same
    through ``dp_mesh_dims`` (torch 2.12+)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    import fsdp_traceable
    from fsdp_traceable.introspection.fake_world import fake_process_group

    dims = getattr(torch.distributed.fsdp, "DataParallelMeshDims", None)  # torch 2.12+
    with fake_process_group(8, rank):
        mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("rep", "shard", "tp"))
        torch.manual_seed(0)
        base = _Uneven()
        layouts, spmd_layouts = [], []
        for fully_shard in (fsdp2_fully_shard, fsdp_traceable.fully_shard):
            model = parallelize_module(
                copy.deepcopy(base), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
            fully_shard(model, mesh=mesh["rep", "shard"])
            # The fake group moves no data: layouts and local shapes only.
            layouts.append({n: (tensor_parallel_cases.layout(p), p.to_local().shape, p.shape)
                            for n, p in model.named_parameters()})
        if dims is not None:  # the same layouts on the whole mesh, through dp_mesh_dims
            # (ours only: in a process that ran other fake worlds, DTensor can hand back an
            # equal mesh object of an earlier one, and FSDP2 checks the mesh's identity)
            model = copy.deepcopy(base)
            # ColwiseParallel's and RowwiseParallel's placements, Replicate() on dp.
            for linear, weight, bias in ((model.up, Shard(0), Shard(0)),
                                         (model.down, Shard(1), Replicate())):
                linear.weight = _on_mesh(linear.weight, mesh, (Replicate(), Replicate(), weight))
                linear.bias = _on_mesh(linear.bias, mesh, (Replicate(), Replicate(), bias))
            fsdp_traceable.fully_shard(model, mesh=mesh,
                                       dp_mesh_dims=dims(shard="shard", replicate="rep"))
            spmd_layouts.append({
                n: (tensor_parallel_cases.layout(p), p.to_local().shape, p.shape)
                for n, p in model.named_parameters()})
    assert layouts[1] == layouts[0]
    for name, spmd_layout in (spmd_layouts[0] if spmd_layouts else {}).items():
        assert spmd_layout == layouts[0][name], f"{name}: {spmd_layout} vs {layouts[0][name]}"
    assert layouts[1]["up.weight"][0][1][:2] == (
        torch.distributed.tensor.Replicate(),
        torch.distributed.tensor.placement_types._StridedShard(0, split_factor=2))
