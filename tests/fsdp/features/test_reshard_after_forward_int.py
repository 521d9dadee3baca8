"""``reshard_after_forward=N`` against torch's FSDP2 on 4 gloo ranks (groups of 2).

Eager, eager forward with a compiled-autograd backward, compiled whole with compiled
autograd, and compiled as one whole step
(``compile_step``; both AOT eager): bitwise losses, gradients and parameters over 3
AdamW steps, and the all-gathers: the forward's over the
4-rank shard group (compiled, in two steps: across the pairs, then within the pair; see
[Note: the post-forward piece, compiled]), the backward's over 2-rank groups. On the
fake process group, what the whole step keeps for backward: the piece, no unsharded
parameter.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch._dynamo.backends.common import aot_autograd
from torch.distributed.device_mesh import init_device_mesh

from fsdp_traceable import compile_step, fully_shard
from fsdp_traceable.fx_ops import op_name
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from fsdp_traceable.tracing import regions_available
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors, region_schedule
from tests.fsdp import compiled_cases, parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases
from tests.fsdp.float8_weight import Float8MLP, shard_float8_mlp
from tests.whole_step_graphs import kept_for_backward


@pytest.mark.gloo
def test_eager_and_compiled_match_fsdp2_bitwise_and_gather_over_groups_of_2() -> None:
    cases = [("subgroups", parity_cases.reshard_to_subgroups, (2,)),
             ("compiled", compiled_cases.reshard_to_subgroups_compiled, (2,)),
             ("eager_forward_ca", compiled_cases.reshard_to_subgroups_eager_forward_ca, (2,))]
    if dynamo_traces_backward_into_dtensors():
        cases.append(("whole_step", compiled_cases.reshard_to_subgroups_whole_step, (2,)))
    results: list[dict[str, Any]] = run_on_local_ranks(run_cases, 4, cases, timeout_s=300)
    for rank, per_rank in enumerate(results):
        result = per_rank["subgroups"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients")
        assert_bitwise(theirs["params"], ours["params"], "full parameters")
        # 2 blocks, [norm, output], root: every forward gather spans the shard group,
        # every backward gather a pair, the root's (embeddings only) too.
        assert theirs["forward_group_sizes"] == [4, 4, 4, 4]
        assert ours["forward_group_sizes"] == theirs["forward_group_sizes"]
        assert theirs["backward_group_sizes"] == [2, 2, 2, 2]
        assert ours["backward_group_sizes"] == theirs["backward_group_sizes"]
        result = per_rank["compiled"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["graph_breaks"] == {}
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients (compiled)")
        assert_bitwise(theirs["params"], ours["params"], "full parameters (compiled)")
        # An eager forward keeps the piece; compiled autograd's backward re-gathers
        # it within the pair, as the eager backward does (1 block, [norm, output]).
        result = per_rank["eager_forward_ca"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        ours = result["ours"]  # the same model and data as "compiled"
        assert ours["graph_breaks"] == {} and ours["graphs"] == 1
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients (eager + CA)")
        assert_bitwise(theirs["params"], ours["params"], "full parameters (eager + CA)")
        pair = [rank // 2 * 2, rank // 2 * 2 + 1]
        assert ours["all_gather_ranks"] == [pair, pair]
        if "whole_step" not in per_rank:
            continue
        result = per_rank["whole_step"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["graphs"] == 1 and ours["graph_breaks"] == {}
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients (whole step)")
        assert_bitwise(theirs["params"], ours["params"], "full parameters (whole step)")
        # 1 block, [norm, output], root (embeddings only): each group's forward gathers
        # across the pairs (ranks 0 and 2, or 1 and 3), then within its pair from that
        # piece; backward re-gathers within the pair for the 2 groups whose backward
        # reads their parameters.
        across, pair = [rank % 2, rank % 2 + 2], [rank // 2 * 2, rank // 2 * 2 + 1]
        gathers = ours["all_gather_ranks"]
        assert [ranks for ranks, backward in gathers if not backward] == [across, pair] * 3
        assert [ranks for ranks, backward in gathers if backward] == [pair, pair]


def test_int_values_map_to_fsdp2_meaning() -> None:
    with fake_process_group(4, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (4,))
        with pytest.raises(ValueError, match=r"reshard_after_forward=3 must be a factor of "
                                             r"the shard mesh size 4"):
            fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=3)
        with pytest.warns(UserWarning, match="reshard_after_forward=1"):
            one = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=1)
        assert one._fsdp_group.settings.reshard_after_forward is False
        four = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=4)
        assert four._fsdp_group.settings.reshard_after_forward is True
        assert four._fsdp_group.settings.post_forward_mesh is None
        two = fully_shard(nn.Linear(4, 4), mesh=mesh, reshard_after_forward=2)
        assert two._fsdp_group.settings.reshard_after_forward is True
        assert two._fsdp_group.settings.post_forward_mesh.group_size == 2
        assert two._fsdp_group.settings.post_forward_mesh.group.size() == 2
        two.set_reshard_after_forward(True)  # a bool replaces the int, as in FSDP2
        assert two._fsdp_group.settings.post_forward_mesh is None


BLOCKS = 4


def _wait_of(start: torch.fx.Node) -> torch.fx.Node:
    (wait,) = start.users
    return wait


def _between(first: torch.fx.Node, last: torch.fx.Node) -> list[torch.fx.Node]:
    nodes = list(first.graph.nodes)
    return nodes[nodes.index(first) + 1 : nodes.index(last)]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward() into DTensor parameters")
def test_whole_step_keeps_the_piece_for_backward() -> None:
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs: Any) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        model = nn.Sequential(*(_Block() for _ in range(BLOCKS)))
        for module in (*model, model):
            fully_shard(module, mesh=mesh, reshard_after_forward=2)

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = model(x).sum()
            loss.backward()
            return loss.detach()

        backend = aot_autograd(fw_compiler=keep, inference_compiler=keep)
        compile_step(step, backend=backend)(torch.randn(2, 16, requires_grad=True))
        (graph,) = graphs
        gathers = [n for n in graph.graph.nodes if "all_gather_into_tensor" in str(n.target)]
        ranks = [(compiled_cases.gathered_ranks(n), bool(n.meta.get("autograd_backward")))
                 for n in gathers]
        pieces = [n.args[0] for n in gathers if n.meta.get("autograd_backward")]
        piece_sources = [compiled_cases.gathered_ranks(p.args[0]) for p in pieces]
        first_steps = [n for n, (group, backward) in zip(gathers, ranks)
                       if group == [0, 2] and not backward]
        second_steps = [n for n, (group, backward) in zip(gathers, ranks)
                        if group == [0, 1] and not backward]
    # Under forward regions, the copy-out reads the rank-order copy of the gathered
    # pieces: still a copy-out region, which the overlap pass does not take for a
    # block's compute.
    copy_outs_after_reorder = [
        n for n in graph.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph
        and any(op_name(a) == "_unsafe_view" for a in n.all_input_nodes)
        and not n.meta.get("autograd_backward")]
    assert len(copy_outs_after_reorder) == (BLOCKS if regions_available() else 0)
    assert not any(region_schedule._is_region_call(n) for n in copy_outs_after_reorder)
    # The first step's wait of blocks 3 and 4 comes after the compute of the block two
    # before (a region call), their second step's after the block before.
    def overlapped(starts: list[torch.fx.Node]) -> list[torch.fx.Node]:
        return [start for start in starts if any(
            region_schedule._is_region_call(n) for n in _between(start, _wait_of(start)))]

    assert overlapped(first_steps) == (first_steps[2:] if regions_available() else [])
    assert overlapped(second_steps) == (second_steps[1:] if regions_available() else [])
    # Per block (rank 0), forward: across the pairs (ranks 0 and 2), then within its pair
    # (0 and 1) from that piece; backward: within the pair from the piece, once per block.
    across, pair = [0, 2], [0, 1]
    assert [group for group, backward in ranks if not backward] == [across, pair] * BLOCKS
    assert [group for group, backward in ranks if backward] == [pair] * BLOCKS
    # What backward re-gathers is the forward's gather across the pairs, waited: half of
    # its block's all-gather output (2 * (16 * 16 + 16) elements).
    assert all("wait_tensor" in str(p.target) for p in pieces)
    assert piece_sources == [across] * BLOCKS
    assert [p.meta["val"].numel() for p in pieces] == [2 * (16 * 16 + 16) // 2] * BLOCKS
    kept = kept_for_backward(graph)
    assert (16, 16) not in kept, kept


def test_compiled_with_all_gather_extensions_raises_clearly() -> None:
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        model = shard_float8_mlp(Float8MLP(), fully_shard, mesh=mesh, reshard_after_forward=2)
        compiled = torch.compile(model.loss, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=r"reshard_after_forward=2 with all-gather "
                                             r"extensions .* runs eagerly only"):
            compiled(torch.randn(4, 16), torch.randn(4, 5))


def test_hsdp_gathers_across_groups_within_its_replica() -> None:
    # Rank 0 of a (replicate 2, shard 4) mesh: its pair is ranks 0 and 1; the compiled
    # forward's first step gathers across the pairs of its own replica only (0 and 2),
    # never from the other replica (4 and 6).
    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 4), mesh_dim_names=("replicate", "shard"))
        model = fully_shard(nn.Linear(16, 16), mesh=mesh, reshard_after_forward=2)
        post_forward_mesh = model._fsdp_group.settings.post_forward_mesh
        assert dist.get_process_group_ranks(post_forward_mesh.group) == [0, 1]
        assert dist.get_process_group_ranks(post_forward_mesh.across_groups) == [0, 2]
