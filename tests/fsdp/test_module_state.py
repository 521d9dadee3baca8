"""The state ``fully_shard.state(module)`` returns, read as FSDP2's ``FSDPState`` is
(single process, fake group of 2)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_traceable import fully_shard


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _nested(mesh) -> nn.Sequential:
    """Two MLPs; the first one's linears sharded alone, the root holds the second."""
    model = nn.Sequential(_mlp(), _mlp())
    fully_shard(model[0][0], mesh=mesh)
    fully_shard(model[0][2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_one_state_per_call_found_by_both_libraries_functions(fake_mesh):
    model = _nested(fake_mesh)
    states = [fully_shard.state(m) for m in (model, model[0][0], model[0][2])]
    assert len({id(s) for s in states}) == 3
    assert [torch_fully_shard.state(m) for m in (model, model[0][0], model[0][2])] == states
    assert model._get_fsdp_state() is states[0]
    assert fully_shard.state(model[1]) is None  # not a fully_shard-ed module
    listed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard([listed[0], listed[1]], mesh=fake_mesh)
    assert fully_shard.state(listed[0]) is fully_shard.state(listed[1])


def test_roots_paths_and_all_states(fake_mesh):
    model = _nested(fake_mesh)
    root, in_proj, out_proj = (fully_shard.state(m) for m in (model, model[0][0], model[0][2]))
    root._lazy_init()
    assert (root._is_root, in_proj._is_root, out_proj._is_root) == (True, False, False)
    assert root._state_ctx.all_states == [root, in_proj, out_proj]
    group = root._fsdp_param_group
    assert group._module_fqn == ""
    assert {p._param_fqn for p in group.fsdp_params} == {
        "1.0.weight", "1.0.bias", "1.2.weight", "1.2.bias"}
    assert in_proj._fsdp_param_group._module_fqn == "0.0"
    assert {p._param_fqn for p in in_proj._fsdp_param_group.fsdp_params} == {
        "0.0.weight", "0.0.bias"}


def test_lazy_init_checks_as_fsdp2(fake_mesh):
    model = _nested(fake_mesh)
    fully_shard.state(model[0][0])._lazy_init()
    with pytest.raises(RuntimeError, match="already been lazily initialized for 0.0\n"
                       "FSDP requires running forward through the root module first"):
        fully_shard.state(model)._lazy_init()
    listed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard([listed[0], listed[1]], mesh=fake_mesh)
    with pytest.raises(RuntimeError, match="FSDP requires a single root module but got"):
        fully_shard.state(listed[0])._lazy_init()


def test_modules_to_run_forward_empties_after_the_pass(fake_mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard([model[0], model[1]], mesh=fake_mesh)
    fully_shard(model, mesh=fake_mesh)
    state = fully_shard.state(model[0])
    seen = []
    model[0].register_forward_hook(lambda *_: seen.append(set(state._modules_to_run_forward)))
    with torch.no_grad():
        model(torch.randn(2, 4))  # the group's pass, inside the root's forward
        assert seen == [{model[1]}] and state._modules_to_run_forward == set()
        model[0](torch.randn(2, 4))  # on its own afterwards: a pass of its own
    assert seen[-1] == set() and state._modules_to_run_forward == set()
