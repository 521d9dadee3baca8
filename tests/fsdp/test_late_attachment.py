"""What a user changes or attaches after ``fully_shard``, against torch's FSDP2 on 2 gloo
ranks, eager, bit for bit: freezing between steps, forward hooks, full backward hooks,
post-accumulate-grad hooks, settings between steps, replaced parameters,
``load_state_dict(assign=True)``, ``module.to(dtype)``, ``module.apply(init_fn)``.
The list with each case's status is the late-attachment table of ``docs/api.md``
(``tests/fsdp/api_surface.py``)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import fsdp_traceable
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import late_attachment_cases as cases
from tests.fsdp.feature_cases import assert_same_training, case_results, run_cases

TRAINING_CASES = ["freeze_between_steps", "module_hooks", "post_accumulate_grad_hook",
                  "settings_between_steps", "replace_before_first_forward",
                  "load_state_dict_assign", "to_dtype_before_forward",
                  "apply_init_between_steps"]
CASES = [(name, getattr(cases, name), ()) for name in
         (*TRAINING_CASES, "replace_between_steps", "replace_with_plain_parameter")]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_on_local_ranks(run_cases, 2, CASES, timeout_s=300)


@pytest.mark.gloo
@pytest.mark.parametrize("name", TRAINING_CASES)
def test_trains_like_fsdp2(two_ranks, name: str) -> None:
    for result in case_results(two_ranks, name):
        assert_same_training(result["theirs"], result["ours"])


@pytest.mark.gloo
def test_hooks_see_and_fire_as_fsdp2s(two_ranks) -> None:
    for result in case_results(two_ranks, "freeze_between_steps"):
        assert result["ours_none"] == result["theirs_none"]
    for result in case_results(two_ranks, "module_hooks"):
        assert result["ours_seen"] == result["theirs_seen"]
        tags = [entry[:2] for entry in result["ours_seen"][:6]]
        # unsharded parameters between the unshard and the reshard (FSDP2's hook order)
        assert tags == [("pre-prepend", "DTensor"), ("pre-before", "Tensor"),
                        ("pre-after", "Tensor"), ("post-prepend", "Tensor"),
                        ("post-before", "Tensor"), ("post-after", "DTensor")]
    for result in case_results(two_ranks, "post_accumulate_grad_hook"):
        theirs, ours = result["theirs_seen"], result["ours_seen"]
        assert len(ours) == len(theirs) == 4  # two reductions a step, none without sync
        for a, b in zip(theirs, ours):
            assert a[:2] == b[:2] and torch.equal(a[2], b[2])
    for result in case_results(two_ranks, "to_dtype_before_forward"):
        assert result["ours_dtypes"] == result["theirs_dtypes"] == ["torch.bfloat16"]


@pytest.mark.gloo
def test_replaced_parameters(two_ranks) -> None:
    for result in case_results(two_ranks, "replace_between_steps"):
        # ours adopts the replacement; FSDP2 got the same values copied in place
        assert result["ours"]["losses"] == result["theirs"]["losses"]
    for result in case_results(two_ranks, "replace_with_plain_parameter"):
        assert result["theirs"].startswith("AttributeError")
        # named by its path under the root, as FSDP2 names parameters
        assert result["ours"].startswith("TypeError: parameter 'layers.0.feed_forward.w1.weight'")


def _sharded_linear(mesh) -> nn.Linear:
    torch.manual_seed(0)
    return fsdp_traceable.fully_shard(nn.Linear(4, 6), mesh=mesh)


def test_a_replacement_laid_out_otherwise_raises_at_the_assignment(fake_mesh) -> None:
    linear = _sharded_linear(fake_mesh)
    old = linear.weight
    other = nn.Parameter(DTensor.from_local(torch.zeros(6, 2), fake_mesh, [Shard(1)]))
    with pytest.raises(ValueError, match="'weight'.*placements"):
        linear.weight = other
    with pytest.raises(TypeError, match="'weight'.*None"):
        linear.weight = None
    assert linear.weight is old and linear._fsdp_group.params.sharded_params[0] is old


def test_hook_handles_remove_hooks_registered_before_and_after(fake_mesh) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    calls: list[str] = []
    before = linear.register_forward_pre_hook(lambda m, a: calls.append("before"))
    fsdp_traceable.fully_shard(linear, mesh=fake_mesh)
    after = linear.register_forward_hook(
        lambda m, args, out: calls.append(f"after, input zero: {not args[0].any()}"),
        prepend=True)
    changed = linear.register_forward_pre_hook(
        lambda m, args, kwargs: ((args[0] * 0,), kwargs), with_kwargs=True)
    linear(torch.ones(2, 4))
    assert calls == ["before", "after, input zero: True"]
    for handle in (before, after, changed):
        handle.remove()
    linear(torch.ones(2, 4))
    assert len(calls) == 2


def test_full_backward_hook_grad_input_precedes_the_input_cast(fake_mesh) -> None:
    """The documented difference: FSDP2 casts a module's inputs in a forward pre-hook,
    before torch wraps them for full backward hooks; ours casts inside ``forward``."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    dtypes = {}
    for name, shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        linear = shard(nn.Linear(4, 4), mesh=fake_mesh, mp_policy=policy)
        linear.register_full_backward_hook(
            lambda m, gin, gout, name=name: dtypes.update({name: (gin[0].dtype, gout[0].dtype)}))
        linear(torch.ones(2, 4, requires_grad=True)).float().sum().backward()
    assert dtypes == {"theirs": (torch.bfloat16, torch.bfloat16),
                      "ours": (torch.float32, torch.bfloat16)}


def test_a_meta_built_model_adopts_loaded_parameters(fake_mesh) -> None:
    """``load_state_dict(assign=True)`` of materialized shards into a model built on meta
    (what torch's ``set_model_state_dict`` does with a full state dict)."""
    with torch.device("meta"):
        linear = fsdp_traceable.fully_shard(nn.Linear(4, 6), mesh=fake_mesh)
    state = {k: nn.Parameter(DTensor.from_local(torch.ones(v.to_local().shape), fake_mesh,
                                                v.placements, shape=v.shape, stride=v.stride()))
             for k, v in linear.state_dict().items()}
    linear.load_state_dict(state, assign=True)
    assert linear.weight is state["weight"] and not linear.weight.is_meta
    assert linear._fsdp_group.params.sharded_params[0] is state["weight"]


def test_a_forward_on_meta_raises_fsdp2s_error_before_the_all_gather(fake_mesh) -> None:
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    messages = []
    for shard in (fsdp2_fully_shard, fsdp_traceable.fully_shard):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        shard(model[0], mesh=fake_mesh)
        shard(model, mesh=fake_mesh)
        with pytest.raises(RuntimeError, match="materialized from meta device") as error:
            model(torch.ones(2, 4))
        messages.append(str(error.value))
    assert messages[0] == messages[1]


def test_a_forward_set_on_the_instance_runs_inside_the_groups_forward(fake_mesh) -> None:
    """A forward set on the instance, before ``fully_shard`` (as torchtitan's
    ``Module.parallelize`` sets one) or after, runs between the unshard and the reshard,
    as under FSDP2's hooks; deleting it restores the class's."""
    seen = []

    def instance_forward_of(linear: nn.Linear, tag: str):
        def forward(x: torch.Tensor) -> torch.Tensor:
            seen.append((tag, type(linear.weight), tuple(linear.weight.shape)))
            return nn.Linear.forward(linear, x)
        return forward

    before = nn.Linear(4, 6)
    before.forward = instance_forward_of(before, "before")
    fsdp_traceable.fully_shard(before, mesh=fake_mesh)
    after = fsdp_traceable.fully_shard(nn.Linear(4, 6), mesh=fake_mesh)
    after.forward = instance_forward_of(after, "after")
    for linear in (before, after):
        assert linear(torch.ones(2, 4)).shape == (2, 6)
        # A root keeps its unsharded parameters (registered) after forward, as FSDP2's.
        assert not isinstance(linear.weight, DTensor)
        linear.reshard()
        assert isinstance(linear.weight, DTensor)
    assert seen == [("before", torch.Tensor, (6, 4)), ("after", torch.Tensor, (6, 4))]
    del after.forward
    after(torch.ones(2, 4))
    assert len(seen) == 2
