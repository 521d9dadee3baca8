"""``reshard_after_forward=N`` against torch's FSDP2 on 4 gloo ranks (groups of 2).

Eager: bitwise losses, gradients and parameters over 3 AdamW steps, and the same
all-gathers: the forward's over the 4-rank shard group, the backward's over 2-rank
groups. Compiled: a clear error (the compiled graph cannot keep the post-forward piece).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_traceable import fully_shard
from fsdp_traceable.testing.fake_world import fake_process_group
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases


@pytest.mark.gloo
def test_eager_matches_fsdp2_bitwise_and_gathers_over_groups_of_2() -> None:
    cases = [("subgroups", parity_cases.reshard_to_subgroups, (2,))]
    results: list[dict[str, Any]] = run_on_local_ranks(run_cases, 4, cases, timeout_s=300)
    for rank, per_rank in enumerate(results):
        result = per_rank["subgroups"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["grads"], ours["grads"], "first-step local gradients")
        assert_bitwise(theirs["params"], ours["params"], "full parameters")
        # 2 blocks, [norm, output], root: every forward gather spans the shard group,
        # every backward gather a pair. FSDP2 re-gathers all 4 groups; ours only the 3
        # whose backward reads their parameters (the root holds only embeddings).
        assert theirs["forward_group_sizes"] == [4, 4, 4, 4]
        assert ours["forward_group_sizes"] == theirs["forward_group_sizes"]
        assert theirs["backward_group_sizes"] == [2, 2, 2, 2]
        assert ours["backward_group_sizes"] == [2, 2, 2]


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


def test_compiled_forward_raises_clearly() -> None:
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (4,))
        model = fully_shard(nn.Linear(8, 8), mesh=mesh, reshard_after_forward=2)
        compiled = torch.compile(model, backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=r"reshard_after_forward=2 .* runs eagerly only"):
            compiled(torch.randn(2, 8))
