"""``compile_step(step, optimizer=...)``: the optimizer's update and ``zero_grad()``
traced into the whole step, against the same optimizer stepped eagerly, under a
learning-rate schedule. The FSDP2 comparison on 2 gloo ranks (AdamW) is in
``compile_tests/test_whole_step.py``; here SGD's and Adam's other paths on one plain
model, ``aot_eager``."""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fsdp_traceable
from fsdp_traceable.whole_step.capture import _followed_by_update, dynamo_traces_backward_into_dtensors

pytestmark = pytest.mark.skipif(
    not dynamo_traces_backward_into_dtensors(),
    reason="this torch's Dynamo cannot trace backward() into DTensor parameters")

STEPS = 3


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4),
                                torch.nn.Linear(4, 4))
    model[3].requires_grad_(False)  # frozen: never stepped
    return model


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    lambda p: torch.optim.Adam(p, lr=0.01, eps=1e-4, amsgrad=True, foreach=True, weight_decay=0.1),
    lambda p: torch.optim.AdamW(p, lr=torch.tensor(0.01), eps=1e-4, fused=True),
], ids=["SGD nesterov", "Adam amsgrad foreach", "AdamW fused tensor lr"])
def test_optimizer_in_step_matches_its_eager_step_in_one_graph(
        make: Callable[..., torch.optim.Optimizer]) -> None:
    eager_model = _model()
    model = copy.deepcopy(eager_model)
    eager, optimizer = make(eager_model.parameters()), make(model.parameters())
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda index: 0.5 ** index)
                 for o in (eager, optimizer)]

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss.detach()

    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = fsdp_traceable.compile_step(step, backend=counter, optimizer=optimizer)
    generator = torch.Generator().manual_seed(0)
    for index in range(STEPS):
        x, y = torch.randn(6, 8, generator=generator), torch.randn(6, 4, generator=generator)
        loss = torch.nn.functional.mse_loss(eager_model(x), y)
        loss.backward()
        eager.step()
        eager.zero_grad()
        torch.testing.assert_close(compiled(x, y), loss.detach(), rtol=0, atol=1e-6)
        for schedule in schedules:
            schedule.step()
        if index == 0:  # a resume: the eager run's checkpoint, new state tensors
            model.load_state_dict(copy.deepcopy(eager_model.state_dict()))
            optimizer.load_state_dict(copy.deepcopy(eager.state_dict()))
    # One graph over every step, the learning rate a different value each time, the
    # state loaded from a checkpoint after the first (updated, not the replaced tensors).
    assert counter.frame_count == 1 and dict(counters["graph_break"]) == {}
    assert all(param.grad is None for param in model.parameters())
    for (name, param), theirs in zip(model.named_parameters(), eager_model.parameters()):
        torch.testing.assert_close(param, theirs, rtol=0, atol=1e-6, msg=name)
    for param, theirs in zip(model.parameters(), eager_model.parameters()):
        state, eager_state = optimizer.state.get(param, {}), eager.state.get(theirs, {})
        assert state.keys() == eager_state.keys()
        for key, value in eager_state.items():
            torch.testing.assert_close(state[key], value, rtol=0, atol=1e-6, msg=key)


class _Update:
    def __init__(self) -> None:
        self.calls = 0

    def update(self) -> None:
        self.calls += 1


def test_the_step_and_update_function_takes_the_steps_own_arguments() -> None:
    # The compiled function has the step's own parameters (a saved step keeps guards on
    # them only): every kind passes through, defaults included; its closure holds the
    # step's module cells themselves.
    model = _model()

    def step(x: torch.Tensor, /, scale: float = 2.0, *rest: object, shift: float = 1.0,
             **extra: object) -> tuple:
        return model(x).sum() * scale + shift, rest, extra

    update = _Update()
    combined = _followed_by_update(step, update)
    x = torch.ones(2, 8)
    assert inspect.signature(combined) == inspect.signature(step).replace(
        return_annotation=inspect.Signature.empty, parameters=[
            p.replace(annotation=inspect.Parameter.empty)
            for p in inspect.signature(step).parameters.values()])
    for args, kwargs in [((x,), {}), ((x, 3.0, "a"), {"shift": 0.5, "k": 1})]:
        assert _same(combined(*args, **kwargs), step(*args, **kwargs))
    assert update.calls == 2
    assert dict(zip(combined.__code__.co_freevars, combined.__closure__))["model"] is \
        step.__closure__[0]
    assert _followed_by_update(lambda x: model(x), update)(x).shape == (2, 4)
    with pytest.raises(TypeError, match="takes a Python function"):
        _followed_by_update(model.forward, update)


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1:] == b[1:]
