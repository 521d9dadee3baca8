"""The state ``fully_shard.state(module)`` returns, read as FSDP2's ``FSDPState`` is
(single process, fake group of 2)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fsdp_traceable import fully_shard
from fsdp_traceable.fsdp.mixed_fully_shard import MixedFullyShardError


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


# -- torch's code that looks a module's FSDP state up (see [Note: torch's FSDPState and
# ours]): torch's fully_shard on the same model is the reference.

def _managed_by_torch(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """What torch's fully_shard applied to ``model`` would manage: module, parameter and
    buffer paths, each sorted, from torch's own ``_get_managed_modules`` /
    ``_get_managed_states``."""
    fsdp_init = pytest.importorskip("torch.distributed.fsdp._fully_shard._fsdp_init")
    modules = fsdp_init._get_managed_modules((model,))
    params, buffers = fsdp_init._get_managed_states(modules)
    names = {id(m): n for n, m in model.named_modules()}
    names.update({id(t): n for n, t in model.named_parameters()})
    names.update({id(t): n for n, t in model.named_buffers()})
    assert len(params) == len({id(p) for p in params})  # each once
    return tuple(sorted(names[id(x)] for x in group) for group in (modules, params, buffers))


def _mlp_with_buffer() -> nn.Sequential:
    model = _mlp()
    model.register_buffer("scale", torch.ones(4))
    return model


def test_torchs_managed_modules_and_states_leave_ours_out_as_fsdp2s(fake_mesh):
    from torch.distributed._composable import replicate

    found = {}
    for name, shard in (("fsdp2", torch_fully_shard), ("ours", fully_shard)):
        model = nn.Sequential(*(_mlp_with_buffer() for _ in range(4)))
        replicate(model[0])
        shard(model[1][0], mesh=fake_mesh)  # nested in a module the root would manage
        shard(model[2], mesh=fake_mesh)
        shard([model[3][0], model[3][2]], mesh=fake_mesh)
        found[name] = _managed_by_torch(model)
    modules, params, buffers = found["ours"]
    assert found["ours"] == found["fsdp2"]
    assert params == ["1.2.bias", "1.2.weight"] and buffers == ["1.scale", "3.scale"]
    assert "0" not in modules and "2" not in modules and "1" in modules


def test_state_is_torchs_fsdp_state_held_weakly_by_torchs_mapping(fake_mesh):
    from torch.distributed._composable_state import _get_module_state, _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    gc.collect()
    before = len(_module_state_mapping)
    model = _nested(fake_mesh)
    state = fully_shard.state(model[0][0])
    assert isinstance(state, FSDPState) and _get_module_state(model[0][0]) is state
    assert _get_module_state(model[0]) is None  # not sharded itself
    assert len(_module_state_mapping) == before + 3
    state_ref = weakref.ref(state)
    del model, state
    gc.collect()
    assert state_ref() is None and len(_module_state_mapping) == before


def test_torch_fully_shard_around_ours_fails_at_its_first_forward(fake_mesh):
    """torch's fully_shard leaves our sharded block out (as FSDP2's nested one) and its
    lazy init, at its root's first forward, raises naming the fix."""
    model = nn.Sequential(_mlp(), _mlp())
    fully_shard(model[0], mesh=fake_mesh)
    ours = [id(p) for p in model[0].parameters()]
    torch_fully_shard(model, mesh=fake_mesh)
    assert [id(p) for p in model[0].parameters()] == ours  # left to ours
    with pytest.raises(MixedFullyShardError, match=r"torch's fully_shard \(FSDP2\) on "
                       r"FSDPSequential encloses '0' \(FSDPSequential\).*Apply "
                       "fsdp_traceable's fully_shard to the enclosing modules too"):
        model(torch.randn(2, 4))


def test_shared_parameter_left_to_its_group_and_raised_at_the_roots_first_forward(fake_mesh):
    model = nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False))
    model[1].weight = model[0].weight
    fully_shard(model[0], mesh=fake_mesh)
    original = model[1].weight
    fully_shard(model[1], mesh=fake_mesh)  # accepted, as FSDP2 accepts it
    fully_shard(model, mesh=fake_mesh)
    assert model[1].weight is original and fully_shard.state(model[1]).shared_params == ["weight"]
    assert model[1]._fsdp_group.params.fqns == []  # nothing sharded twice
    message = r"parameter '1.weight' is shared with a parameter already managed by another"
    with pytest.raises(ValueError, match=message):
        model(torch.arange(3))
    with pytest.raises(ValueError, match=message):
        fully_shard.state(model)._lazy_init()
