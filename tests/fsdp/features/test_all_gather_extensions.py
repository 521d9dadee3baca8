"""A local tensor subclass with fsdp_pre/post_all_gather hooks, eager, against FSDP2."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from typing import ClassVar

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

import fsdp_traceable
from fsdp_traceable.fsdp import group_all_gather
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.feature_cases import record_all_gathers
from tests.fsdp.float8_weight import (
    Float8CastWeight,
    Float8MLP,
    WrappedWeight,
    plain,
    shard_float8_mlp,
)

STEPS = 3
WORLD_SIZE = 2


def recorded_all_gathers() -> contextlib.AbstractContextManager[list[tuple[int, torch.Tensor]]]:
    """Records every c10d flat all-gather: (input bytes, output tensor), in call order."""
    return record_all_gathers(
        lambda output, input, group: (input.numel() * input.element_size(), output))


class _ByteAllGather(DefaultAllGather):
    """FSDP2's all-gather with float8 buckets sent as bytes (gloo has no float8)."""

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        if output_tensor.element_size() == 1:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return super().__call__(output_tensor, input_tensor, group, async_op)


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step * WORLD_SIZE + rank)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 5, generator=generator)


def _train(model: nn.Module, rank: int) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses, grads = [], []
    with recorded_all_gathers() as records:
        for step in range(STEPS):
            loss = model.loss(*_batch(step, rank))
            loss.backward()
            grads.append([plain(p.grad) for p in model.parameters()])
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    return {
        "losses": losses, "grads": grads, "params": [plain(p) for p in model.parameters()],
        "gathered": [(nbytes, output.view(torch.uint8).clone()) for nbytes, output in records],
    }


def _eager_against_fsdp2(rank: int, world_size: int, float8_only_bucket: bool) -> dict:
    torch.manual_seed(0)
    base = Float8MLP(float8_only_bucket)
    theirs = shard_float8_mlp(copy.deepcopy(base), fsdp2_fully_shard)
    if float8_only_bucket:
        theirs.second.set_custom_all_gather(_ByteAllGather())
    ours = shard_float8_mlp(copy.deepcopy(base), fsdp_traceable.fully_shard)
    result = {"theirs": _train(theirs, rank), "ours": _train(ours, rank)}
    result["hooked"] = [
        [e is not None for e in m._fsdp_group.params.extensions]
        for m in (ours.first, ours.second, ours.ordinary)
    ]
    return result


@pytest.fixture(scope="module", params=[False, True], ids=["mixed_buckets", "float8_only_bucket"])
def eager_runs(request) -> tuple[bool, list[dict]]:
    return request.param, run_on_local_ranks(_eager_against_fsdp2, WORLD_SIZE, request.param)


@pytest.mark.gloo
def test_eager_training_is_bitwise_fsdp2(eager_runs):
    _, ranks = eager_runs
    for run in ranks:
        theirs, ours = run["theirs"], run["ours"]
        assert ours["losses"] == theirs["losses"]
        for grads_theirs, grads_ours in zip(theirs["grads"], ours["grads"]):
            assert all(torch.equal(a, b) for a, b in zip(grads_theirs, grads_ours))
        assert all(torch.equal(a, b) for a, b in zip(theirs["params"], ours["params"]))


@pytest.mark.gloo
def test_all_gathered_bytes_equal_fsdp2(eager_runs):
    _, ranks = eager_runs
    for run in ranks:
        theirs, ours = run["theirs"]["gathered"], run["ours"]["gathered"]
        assert len(ours) == len(theirs) == STEPS * 6  # 3 groups, forward + backward
        for (bytes_theirs, out_theirs), (bytes_ours, out_ours) in zip(theirs, ours):
            assert bytes_ours == bytes_theirs
            assert torch.equal(out_ours, out_theirs)


@pytest.mark.gloo
def test_float8_weights_all_gather_one_byte_per_element(eager_runs):
    float8_only_bucket, ranks = eager_runs
    # Rows per rank at 2 ranks: 13 -> 7, 9 -> 5 (padded); 5 -> 3. Weights 1 byte per
    # element, fp32 biases and the ordinary linear 4.
    first = 7 * 16 * 1 + 7 * 4
    second = 5 * 13 * 1 + (0 if float8_only_bucket else 5 * 4)
    ordinary = (3 * 9 + 3) * 4
    per_step = [first, second, ordinary, ordinary, second, first]
    for run in ranks:
        assert [nbytes for nbytes, _ in run["ours"]["gathered"]] == per_step * STEPS
        assert run["hooked"] == [[True, False], [True] if float8_only_bucket else [True, False],
                                 [False, False]]


# -- hooks set after fully_shard: FSDP2 looks them up at every all-gather ------------


class LateHookWeight(WrappedWeight):
    """A wrapper weight that gets Float8CastWeight's hooks only after fully_shard."""


# Calls of the hooks below, by hook name ("pre", "post").
HOOK_CALLS: Counter[str] = Counter()


def _counted_float8_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    HOOK_CALLS["pre"] += 1
    return Float8CastWeight.fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module,
                                                mp_policy)


def _counted_float8_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *,
                                    out=None):
    HOOK_CALLS["post"] += 1
    return Float8CastWeight.fsdp_post_all_gather(self, all_gather_outputs, metadata,
                                                 param_dtype, out=out)


def _bf16_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    HOOK_CALLS["pre"] += 1
    return (self.to(torch.bfloat16),), None


@torch.no_grad()
def _bf16_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    HOOK_CALLS["post"] += 1
    (gathered,) = all_gather_outputs
    if out is not None:  # FSDP2 refills its unsharded parameter from the 2nd all-gather on
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(gathered)
        return None
    unsharded = gathered.to(param_dtype)
    return unsharded, (gathered, unsharded)


class EvenMLP(nn.Module):
    """Linears whose weights shard evenly over 2 ranks, so FSDP2 keeps the local tensor
    objects (and the hooks bound onto them) at its lazy init."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 8)
        self.second = nn.Linear(8, 6)
        self.ordinary = nn.Linear(6, 5)

    forward = Float8MLP.forward
    loss = Float8MLP.loss


def _bind_instance_hooks(model: nn.Module) -> None:
    for linear in (model.first, model.second):
        local = linear.weight._local_tensor
        # As FSDP2's tests do: methods bound onto the plain local tensor object.
        local.fsdp_pre_all_gather = _bf16_pre_all_gather.__get__(local)
        local.fsdp_post_all_gather = _bf16_post_all_gather.__get__(local)


def _hooks_set_after_fully_shard(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = Float8MLP()
    for linear in (base.first, base.second):
        linear.weight = nn.Parameter(LateHookWeight(linear.weight.detach()._tensor))
    results = {}
    for name, fully_shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model = shard_float8_mlp(copy.deepcopy(base), fully_shard)
        LateHookWeight.fsdp_pre_all_gather = _counted_float8_pre_all_gather
        LateHookWeight.fsdp_post_all_gather = _counted_float8_post_all_gather
        HOOK_CALLS.clear()
        results[f"class_{name}"] = {**_train(model, rank), "calls": dict(HOOK_CALLS)}
        del LateHookWeight.fsdp_pre_all_gather, LateHookWeight.fsdp_post_all_gather
    torch.manual_seed(0)
    base = EvenMLP()
    for name, fully_shard in (("theirs", fsdp2_fully_shard), ("ours", fsdp_traceable.fully_shard)):
        model = shard_float8_mlp(copy.deepcopy(base), fully_shard)
        _bind_instance_hooks(model)
        HOOK_CALLS.clear()
        results[f"instance_{name}"] = {**_train(model, rank), "calls": dict(HOOK_CALLS)}
    return results


@pytest.mark.gloo
def test_hooks_set_after_fully_shard_are_used_as_fsdp2_uses_them():
    # Per step, the two hooked weights are all-gathered in forward and again in backward.
    all_gathers = STEPS * 2 * 2
    for run in run_on_local_ranks(_hooks_set_after_fully_shard, WORLD_SIZE):
        for case in ("class", "instance"):
            theirs, ours = run[f"{case}_theirs"], run[f"{case}_ours"]
            # The first linear's backward re-gathers too, though it never reads the
            # weight (its input needs no gradient): see [Note: the re-gather at the
            # backward's start].
            assert theirs["calls"] == {"pre": all_gathers, "post": all_gathers}, case
            assert ours["calls"] == theirs["calls"], case
            assert ours["losses"] == theirs["losses"], case
            assert all(torch.equal(a, b) for a, b in zip(theirs["params"], ours["params"])), case
            assert len(ours["gathered"]) == len(theirs["gathered"]) == STEPS * 6, case
            for (bytes_theirs, out_theirs), (bytes_ours, out_ours) in zip(
                    theirs["gathered"], ours["gathered"]):
                assert bytes_ours == bytes_theirs, case
                assert torch.equal(out_ours, out_theirs), case


# -- single process: detection, signatures, errors ------------------------------------


class _MeshOnlyWeight(Float8CastWeight):
    """The older one-argument pre hook (even sharding: no padding needed)."""

    calls: ClassVar[list[tuple]] = []

    def fsdp_pre_all_gather(self, mesh):
        _MeshOnlyWeight.calls.append((mesh,))
        return (self._tensor,), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        return all_gather_outputs[0], ()


class _UnpaddedWeight(Float8CastWeight):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        return (self._tensor,), None


class _PreOnlyWeight(WrappedWeight):
    def fsdp_pre_all_gather(self, mesh):
        return (self._tensor,), None


class _ThreeArgWeight(Float8CastWeight):
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride):
        return (self._tensor,), None


def _linear_with(weight_type: type, out_features: int = 12) -> nn.Linear:
    linear = nn.Linear(16, out_features)
    linear.weight = nn.Parameter(weight_type(linear.weight.detach()))
    return linear


def test_one_argument_pre_hook_gets_the_shard_mesh(fake_world):
    mesh = init_device_mesh("cpu", (2,))
    linear = fsdp_traceable.fully_shard(_linear_with(_MeshOnlyWeight), mesh=mesh)
    _MeshOnlyWeight.calls.clear()
    linear(torch.randn(3, 16))
    assert _MeshOnlyWeight.calls == [(mesh,)]
    assert linear._fsdp_group.params.extensions[0].module is linear


def test_ordinary_parameters_take_the_plain_path(fake_world):
    linear = fsdp_traceable.fully_shard(nn.Linear(16, 12), mesh=init_device_mesh("cpu", (2,)))
    group = linear._fsdp_group
    assert group.params.extensions == [None, None]
    pending = group.start_all_gather()
    assert pending.hook_inputs is None
    assert pending.result.infos == tuple(group.params.infos)
    group.finish_all_gather(pending)


@pytest.mark.parametrize("weight_type,message", [
    (_PreOnlyWeight, "defines only one of fsdp_pre_all_gather / fsdp_post_all_gather"),
    (_ThreeArgWeight, "fsdp_pre_all_gather takes 3 arguments"),
])
def test_malformed_hooks_raise_at_fully_shard(fake_world, weight_type: type, message: str):
    with pytest.raises(TypeError, match=message) as error:
        fsdp_traceable.fully_shard(_linear_with(weight_type), mesh=init_device_mesh("cpu", (2,)))
    assert "'weight'" in str(error.value)


def test_unpadded_input_of_uneven_shard_raises_before_the_all_gather(monkeypatch):
    with fake_process_group(2, rank=1):  # rank 1 holds 6 of 13 rows, padded to 7
        linear = fsdp_traceable.fully_shard(
            _linear_with(_UnpaddedWeight, out_features=13), mesh=init_device_mesh("cpu", (2,))
        )
        started = []
        monkeypatch.setattr(group_all_gather, "foreach_all_gather", lambda *a, **k: started.append(a))
        with pytest.raises(ValueError, match=r"'weight'.*padded sharded size \(7, 16\)"):
            linear(torch.randn(3, 16))
        assert started == []
