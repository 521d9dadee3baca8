"""Our modules pass as torch's ``FSDPModule``: ``isinstance``, every torch method
overridden (implemented or a clear ``NotImplementedError``), and
``register_fsdp_forward_method`` against FSDP2 on 2 and 3 gloo ranks, bitwise."""

from __future__ import annotations

from typing import Any

import pytest
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from fsdp_traceable import FSDPModule, fully_shard
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases

IMPLEMENTED = {"unshard", "reshard", "reset_iter_state", "set_requires_gradient_sync",
               "set_reshard_after_forward", "set_reshard_after_backward",
               "set_is_last_backward", "_get_fsdp_state", "_apply", "set_requires_all_reduce",
               "set_gradient_divide_factor", "set_reduce_scatter_divide_factor",
               "set_force_sum_reduction_for_comms", "set_reduce_scatter_unused_params",
               "set_all_reduce_hook", "set_modules_to_forward_prefetch",
               "set_modules_to_backward_prefetch", "set_unshard_in_backward",
               "set_post_optim_event", "set_custom_all_gather", "set_custom_reduce_scatter",
               "set_symm_mem_for_comm", "set_allocate_memory_from_process_group_for_comm",
               "_set_unshard_async_op"}


def test_sharded_modules_are_torch_fsdp_modules(fake_mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=fake_mesh)
    fully_shard(model, mesh=fake_mesh)
    assert isinstance(model, TorchFSDPModule) and isinstance(model[0], TorchFSDPModule)
    assert not isinstance(model[1], TorchFSDPModule)
    # torch's __new__ (used when a container is sliced) builds the original class.
    assert type(model[0:1]) is nn.Sequential


def test_every_torch_fsdp_module_method_is_ours(fake_mesh):
    module = fully_shard(nn.Linear(4, 4), mesh=fake_mesh)
    torch_methods = {name for name, value in vars(TorchFSDPModule).items()
                     if callable(value) and not name.startswith("__")}
    assert IMPLEMENTED <= torch_methods
    for name in torch_methods:
        assert name in vars(FSDPModule), f"torch's FSDPModule.{name} is not overridden"
    for name in sorted(torch_methods - IMPLEMENTED):
        with pytest.raises(NotImplementedError, match=f"FSDPModule.{name} is not supported"):
            getattr(module, name)()


def test_set_reshard_after_forward_takes_recurse_positionally(fake_mesh):
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=fake_mesh)
    fully_shard(model, mesh=fake_mesh)
    assert model._fsdp_group.settings.reshard_after_forward is False  # the root's default
    model.set_reshard_after_forward(True, False)
    assert model._fsdp_group.settings.reshard_after_forward is True
    model.set_reshard_after_forward(False, recurse=True)
    assert model[0]._fsdp_group.settings.reshard_after_forward is False


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict[str, Any]]:
    cases = [("forward_methods", parity_cases.forward_methods, ())]
    return run_on_local_ranks(run_cases, request.param, cases, timeout_s=300)


@pytest.mark.gloo
def test_register_fsdp_forward_method_matches_fsdp2(ranks):
    for rank, per_rank in enumerate(ranks):
        result = per_rank["forward_methods"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        theirs, ours = result["theirs"], result["ours"]
        assert ours["is_torch_fsdp_module"] and theirs["is_torch_fsdp_module"]
        assert_bitwise(theirs["outputs"], ours["outputs"], "method outputs")
        assert_bitwise(theirs["params"], ours["params"], "parameters after 4 steps")
