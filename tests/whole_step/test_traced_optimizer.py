"""The optimizer's update prepared for tracing into the whole step
(``fsdp_traceable/whole_step/traced_optimizer.py``): what it refuses, and the state it creates
against the state eager ``step()`` creates. Its numbers, traced: ``compile_tests/
test_traced_optimizer.py`` and ``compile_tests/test_whole_step.py``."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from fsdp_traceable.whole_step.traced_optimizer import TracedOptimizer


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    model[0].bias.requires_grad_(False)  # frozen: no state, in eager or here
    return model


class _MyAdamW(torch.optim.AdamW):
    pass


@pytest.mark.parametrize("make", [
    lambda params: torch.optim.RMSprop(params),
    lambda params: _MyAdamW(params),
], ids=["RMSprop", "AdamW subclass"])
def test_refuses_an_optimizer_whose_step_it_would_not_run(
        make: Callable[..., torch.optim.Optimizer]) -> None:
    with pytest.raises(TypeError, match=r"torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD"):
        TracedOptimizer(make(_model().parameters()))


def _step_hook(optimizer: torch.optim.Optimizer) -> None:
    optimizer.register_step_pre_hook(lambda *args: None)


def _grad_scale(optimizer: torch.optim.Optimizer) -> None:
    optimizer.grad_scale = torch.ones(())


@pytest.mark.parametrize("make, setup, message", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), None, "dampening=0.1"),
    (lambda p: torch.optim.Adam(p, differentiable=True), None, "differentiable=True"),
    (lambda p: torch.optim.AdamW(p), _step_hook, "step pre/post hooks"),
    (lambda p: torch.optim.AdamW(p), _grad_scale, "grad_scale"),
], ids=["SGD dampening", "differentiable", "step hook", "grad scaler"])
def test_refuses_what_its_update_cannot_honour(make: Callable[..., torch.optim.Optimizer],
                                               setup: Callable[..., None] | None,
                                               message: str) -> None:
    optimizer = make(_model().parameters())
    if setup is None:
        with pytest.raises(ValueError, match=message):
            TracedOptimizer(optimizer)
        return
    traced = TracedOptimizer(optimizer)
    setup(optimizer)  # after construction: every call checks again
    with pytest.raises(ValueError, match=message):
        traced.prepare()


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True),
    lambda p: torch.optim.Adam(p, lr=0.01, amsgrad=True),
    lambda p: torch.optim.AdamW(p, lr=0.01),
], ids=["SGD", "Adam amsgrad", "AdamW"])
def test_creates_the_state_eager_step_creates(make: Callable[..., torch.optim.Optimizer]) -> None:
    eager_model, model = _model(), _model()
    eager = make(eager_model.parameters())
    for param in eager_model.parameters():
        param.grad = torch.ones_like(param) if param.requires_grad else None
    eager.step()

    optimizer = make(model.parameters())
    traced = TracedOptimizer(optimizer)
    traced.prepare()
    assert optimizer._opt_called  # a learning-rate scheduler sees the optimizer stepped
    assert all(param.grad is None for param in model.parameters())
    names = {param: name for name, param in model.named_parameters()}
    eager_names = {param: name for name, param in eager_model.named_parameters()}
    ours = {names[p]: state for p, state in optimizer.state.items()}
    theirs = {eager_names[p]: state for p, state in eager.state.items()}
    assert ours.keys() == theirs.keys() and "0.bias" not in ours
    for name, state in theirs.items():
        assert ours[name].keys() == state.keys(), name
        for key, value in state.items():
            created = ours[name][key]
            assert (created.dtype, created.device, created.shape) == (
                value.dtype, value.device, value.shape), f"{name} {key}"
            assert not created.any(), f"{name} {key}: created as zeros, step 0"
    # The learning rate is a tensor the graph reads: a new value needs no recompile.
    optimizer.param_groups[0]["lr"] = 0.5
    traced.prepare()
    assert [plan.lr.item() for plan in traced._plans] == [0.5]
