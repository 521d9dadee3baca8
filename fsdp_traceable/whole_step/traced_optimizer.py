"""The optimizer's update and ``zero_grad()`` traced into the whole step:
``compile_step(step, optimizer=...)``.

[Note: the optimizer in the step]
``optimizer.step()`` cannot be traced after an in-graph backward: torch's optimizers
graph-break at ``step()`` on purpose, and Dynamo's optimizer support builds the state from
the real parameters' ``.grad``, which the traced backward has not written yet ("optimizer:
pending mutation on parameter"). So the step traces what ``step()`` itself calls, torch's
functional update (``torch.optim.adam.adam``, ``torch.optim.sgd.sgd``), over the
optimizer's own state tensors and hyperparameters. Before every call, eagerly,
:meth:`TracedOptimizer.prepare`

- creates the state ``step()`` would create on its first call: Adam's and AdamW's by the
  optimizer's own ``_init_group``; SGD's momentum buffer as zeros, which with
  ``dampening=0`` makes the first step's buffer the gradient exactly, as eager's clone;
- copies each group's ``lr`` into a float64 tensor on the parameters' device, an input
  of the graph, so a learning-rate schedule never recompiles (the other hyperparameters
  are constants of the graph: changing one recompiles, never runs stale). One element,
  not 0-d (torch's update squeezes it): Dynamo reads a 0-d CPU tensor's value as a
  symbolic float, and the update's uses of it made Dynamo restart the whole step's
  trace;
- collects each group's parameters and state tensors again (``load_state_dict``
  replaces them);
- marks the optimizer stepped for a learning-rate scheduler, as the scheduler's own
  wrapper of ``step()`` does (``_opt_called``).

The traced :meth:`TracedOptimizer.update` then updates the parameters whose gradient
the step's backward wrote and sets every parameter's ``.grad`` to ``None``, as
``zero_grad()`` does. A ``fused=True`` group takes the same traced update (torch's fused
kernels are not traceable; compiled, the update's kernels are Inductor's either way).
The numbers are those of ``torch.compile`` over ``step()``: the bias corrections are
tensor math in the graph where eager takes them as Python floats
(measured on 2 gloo ranks after 3 AdamW steps: parameters within 4.8e-7 of FSDP2
eager's with ``aot_eager`` and with Inductor; ``compile_tests/test_whole_step.py`` pins
1e-5).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
from torch.optim import optimizer as optimizer_module
from torch.optim.adam import adam
from torch.optim.sgd import sgd

from ..fsdp import stale_optimizers

__all__ = ["TracedOptimizer"]

log = logging.getLogger(__name__)

# Exact types: a subclass may override step(), which the traced update would not run.
_ADAM_FAMILY = (torch.optim.Adam, torch.optim.AdamW)
_SUPPORTED = (*_ADAM_FAMILY, torch.optim.SGD)
# A group's entries that are not constants of the traced update.
_NOT_CONSTANTS = ("params", "lr")


@dataclasses.dataclass
class _GroupPlan:
    """One parameter group as the traced update reads it, collected before a call."""

    hyperparameters: dict[str, Any]  # the group's settings but params and lr
    lr: torch.Tensor
    params: list[torch.Tensor]
    # (state name, one tensor per parameter) pairs: a tuple, not a dict, as Dynamo
    # guards the key order of a dict the update iterates, which a saved step cannot check.
    state: tuple[tuple[str, list[torch.Tensor]], ...]
    has_complex: bool


class TracedOptimizer:
    """``optimizer.step()`` then ``optimizer.zero_grad()``, traced inside the whole step.

    Args:
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over the step's
            parameters.

    Raises:
        TypeError: for another optimizer type (its ``step()`` would not be what runs).
        ValueError: for a setting the traced update cannot honour (see :meth:`prepare`).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        if type(optimizer) not in _SUPPORTED:
            names = ", ".join(f"torch.optim.{kind.__name__}" for kind in _SUPPORTED)
            raise TypeError(
                f"compile_step(optimizer=...) traces the update of {names} (exact types); "
                f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}: call its "
                "step() and zero_grad() after the compiled step instead"
            )
        self.optimizer = optimizer
        self._lrs: list[torch.Tensor] = []
        self._plans: list[_GroupPlan] = []
        self._check_settings()

    def prepare(self) -> None:
        """Eagerly, before each call: creates missing state, copies each group's
        learning rate into its tensor and collects what :meth:`update` reads.

        Raises:
            ValueError: if the optimizer has step hooks, a ``differentiable`` group, a
                gradient scaler's ``grad_scale``/``found_inf``, or an SGD group with
                momentum and ``dampening != 0``.
        """
        self._check_settings()
        self._create_missing_state()
        groups = self.optimizer.param_groups
        while len(self._lrs) < len(groups):  # add_param_group
            device = _device_of(groups[len(self._lrs)])
            self._lrs.append(torch.zeros(1, dtype=torch.float64, device=device))
        self._plans = [self._plan(group, lr) for group, lr in zip(groups, self._lrs)]
        self.optimizer._opt_called = True  # type: ignore[attr-defined]

    def describe(self) -> str:
        """What the traced update takes as constants: the optimizer type, and per group
        its settings but the learning rate and its parameters' layouts (a saved step's
        key, see ``step_cache``)."""
        groups = []
        for group in self.optimizer.param_groups:
            settings = {name: _value_text(value) for name, value in sorted(group.items())
                        if name not in _NOT_CONSTANTS}
            layouts = [(tuple(p.shape), str(p.dtype), p.requires_grad) for p in group["params"]]
            groups.append(f"{settings} {layouts}")
        return f"{type(self.optimizer).__qualname__} {groups}"

    def update(self) -> None:
        """The update and ``zero_grad()``; traced inside the step, after its backward."""
        with torch.no_grad():
            for plan in self._plans:
                with_grad = [i for i, param in enumerate(plan.params) if param.grad is not None]
                if with_grad:
                    self._update_group(plan, with_grad)
        for plan in self._plans:
            for param in plan.params:
                param.grad = None

    def _check_settings(self) -> None:
        optimizer = self.optimizer
        # fully_shard's check of optimizers built before it is run here, not as a hook.
        stale_optimizers.check(optimizer)
        global_pre_hooks = [hook for hook in optimizer_module._global_optimizer_pre_hooks.values()
                            if not stale_optimizers.is_stale_check(hook)]
        hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
                 global_pre_hooks, optimizer_module._global_optimizer_post_hooks)
        if any(hooks):
            raise ValueError(
                "compile_step(optimizer=...): the optimizer has step pre/post hooks, which "
                "the traced update would not run; remove them, or call optimizer.step() "
                "after the compiled step instead"
            )
        for name in ("grad_scale", "found_inf"):
            if getattr(optimizer, name, None) is not None:
                raise ValueError(
                    f"compile_step(optimizer=...): the optimizer carries a gradient "
                    f"scaler's {name}, which the traced update does not take; unscale "
                    "outside, or call optimizer.step() after the compiled step instead"
                )
        for index, group in enumerate(optimizer.param_groups):
            if group.get("differentiable"):
                raise ValueError(
                    f"compile_step(optimizer=...): param_groups[{index}] has "
                    "differentiable=True, which an update under no_grad cannot honour; "
                    "set differentiable=False"
                )
            if isinstance(optimizer, torch.optim.SGD) and group["momentum"] != 0 \
                    and group["dampening"] != 0:
                raise ValueError(
                    f"compile_step(optimizer=...): param_groups[{index}] has SGD momentum "
                    f"with dampening={group['dampening']}; eager SGD's first step skips "
                    "the dampening, which a momentum buffer created before the step "
                    "cannot: set dampening=0, or call optimizer.step() after the "
                    "compiled step"
                )

    def _create_missing_state(self) -> None:
        optimizer = self.optimizer
        missing = [(group, [p for p in group["params"]
                            if p.requires_grad and not optimizer.state.get(p)])
                   for group in optimizer.param_groups]
        if not any(params for _, params in missing):
            return
        with torch.no_grad():
            for group, params in missing:
                if isinstance(optimizer, _ADAM_FAMILY):
                    _adam_initial_state(optimizer, group, params)
                elif group["momentum"] != 0:
                    for param in params:
                        optimizer.state[param]["momentum_buffer"] = torch.zeros_like(
                            param, memory_format=torch.preserve_format)
        log.debug("in-step optimizer: created state for %d parameters",
                  sum(len(params) for _, params in missing))

    def _plan(self, group: dict[str, Any], lr: torch.Tensor) -> _GroupPlan:
        lr.fill_(float(group["lr"]))  # (a tensor lr too: its own 0-d CPU tensor would restart)
        params = [p for p in group["params"] if p.requires_grad]
        state_names = _state_names(self.optimizer, group)
        state = tuple((name, [self.optimizer.state[p][name] for p in params])
                      for name in state_names)
        hyperparameters = {k: v for k, v in group.items() if k not in _NOT_CONSTANTS}
        return _GroupPlan(hyperparameters, lr, params, state,
                          has_complex=any(torch.is_complex(p) for p in params))

    def _update_group(self, plan: _GroupPlan, with_grad: list[int]) -> None:
        settings = plan.hyperparameters
        params = [plan.params[i] for i in with_grad]
        grads = [param.grad for param in params]
        state = {name: [tensors[i] for i in with_grad] for name, tensors in plan.state}
        if isinstance(self.optimizer, _ADAM_FAMILY):
            beta1, beta2 = settings["betas"]
            # A tensor lr needs capturable for the foreach update (torch raises otherwise);
            # compiled, the kernels are Inductor's either way.
            foreach = settings["foreach"] and (settings["capturable"]
                                               or not isinstance(plan.lr, torch.Tensor))
            adam(params, grads, state["exp_avg"], state["exp_avg_sq"],
                 state.get("max_exp_avg_sq", []), state["step"], foreach=foreach,
                 capturable=settings["capturable"], differentiable=False,
                 fused=False, grad_scale=None, found_inf=None,
                 has_complex=plan.has_complex,
                 decoupled_weight_decay=settings["decoupled_weight_decay"],
                 amsgrad=settings["amsgrad"], beta1=beta1, beta2=beta2, lr=plan.lr,
                 weight_decay=settings["weight_decay"], eps=settings["eps"],
                 maximize=settings["maximize"])
        else:
            sgd(params, grads, state.get("momentum_buffer", []), has_sparse_grad=False,
                foreach=settings["foreach"], fused=False, grad_scale=None,
                found_inf=None, weight_decay=settings["weight_decay"],
                momentum=settings["momentum"], lr=plan.lr, dampening=settings["dampening"],
                nesterov=settings["nesterov"], maximize=settings["maximize"])


def _device_of(group: dict[str, Any]) -> torch.device:
    """Where a group's update computes: its parameters' (local) device."""
    params = group["params"]
    if not params:
        return torch.device("cpu")
    param = params[0]
    return getattr(param, "_local_tensor", param).device


def _value_text(value: object) -> str:
    return repr(value.tolist()) if isinstance(value, torch.Tensor) else repr(value)


def _state_names(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> tuple[str, ...]:
    if isinstance(optimizer, _ADAM_FAMILY):
        return ("step", "exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
    return ("momentum_buffer",) if group["momentum"] != 0 else ()


def _adam_initial_state(optimizer: torch.optim.Optimizer, group: dict[str, Any],
                        params: list[torch.Tensor]) -> None:
    """The state Adam's first ``step()`` creates for ``params``, by its own
    ``_init_group`` (which creates state only for parameters holding a gradient)."""
    held = [param.grad for param in params]
    try:
        for param in params:
            param.grad = torch.zeros_like(param)
        optimizer._init_group({**group, "params": params}, [], [], [], [], [], [])
    finally:
        for param, grad in zip(params, held):
            param.grad = grad
