"""Which tensor a sharded module's parameter attribute reads: the sharded parameter,
or, while its group's unsharded parameters are bound (during forward), the unsharded one;
and which tensor the module registers (``module._parameters``) in eager mode.

``fully_shard`` swaps each module holding parameters of a group for a subclass with
one property per such parameter (:func:`owner_class`); the property reads the module's
``_fsdp_unsharded`` dict first, which :func:`bind_unsharded` fills and
:func:`unbind_unsharded` empties. :func:`register_tensors` and :func:`register_bound`
write the registered parameters (see [Note: registered parameters] in param_registration.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..tracing import in_backward

# (module, attribute name, parameter index): one module attribute holding a parameter.
Binding = tuple[nn.Module, str, int]

# The classes swapped in, per (module class, parameter names): process-wide, as FSDP2's
# per-class cache. They hold no model state (the unsharded parameters live in each
# module's __dict__), their number is bounded by the program's module classes, and two
# models of one architecture must get the same classes: Dynamo guards on a module's
# type, so a class per model would recompile every block of every new model.
_owner_classes: dict[tuple[type, tuple[str, ...]], type] = {}


def is_bound(bindings: list[Binding]) -> bool:
    """Whether unsharded parameters are bound to ``bindings`` right now."""
    if not bindings:
        return False
    owner, name, _ = bindings[0]
    return name in owner.__dict__["_fsdp_unsharded"]


def bind_unsharded(bindings: list[Binding],
                   unsharded: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    """Makes each binding's module read ``unsharded`` (by parameter index) for its attribute."""
    for owner, name, i in bindings:
        owner.__dict__["_fsdp_unsharded"][name] = unsharded[i]


def unbind_unsharded(bindings: list[Binding]) -> None:
    """Makes each binding's module read its sharded parameter again."""
    for owner, name, _ in bindings:
        owner.__dict__["_fsdp_unsharded"].pop(name, None)


def register_tensors(bindings: list[Binding],
                     tensors: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    """Registers ``tensors`` (by parameter index) as each binding's module parameter,
    written to ``_parameters`` directly: past :func:`register_parameter`, which would
    take it for a user's replacement of the sharded parameter."""
    for owner, name, i in bindings:
        owner._parameters[name] = tensors[i]


def register_bound(bindings: list[Binding]) -> None:
    """Registers each binding's bound unsharded parameter (the tensor its attribute reads)."""
    for owner, name, _ in bindings:
        owner._parameters[name] = owner.__dict__["_fsdp_unsharded"][name]


def param_property(name: str) -> property:
    """The attribute ``name``: its bound unsharded parameter, else the sharded one."""
    def get(self: nn.Module) -> torch.Tensor:
        unsharded = self.__dict__["_fsdp_unsharded"].get(name)
        if unsharded is not None:
            return unsharded
        if not torch.compiler.is_compiling() and in_backward():
            # A recompute of activation checkpointing: see [Note: activation checkpointing].
            return self.__dict__["_fsdp_holders"][name].param_in_backward(self, name)
        return self._parameters[name]

    return property(get)


def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """``nn.Module.register_parameter`` of the swapped-in classes: ``module.weight = ...``
    and ``load_state_dict(assign=True)`` come here. A sharded parameter's replacement is
    checked and adopted by its group (see [Note: replaced parameters])."""
    group = self.__dict__.get("_fsdp_holders", {}).get(name)  # a ParamGroup
    if group is None:
        _register_on(self, name, param)
        return
    group.replace_param(self, name, param, _register_on)


def _register_on(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """The ``register_parameter`` the swapped-in classes override."""
    _overridden(module, "register_parameter", register_parameter)(name, param)


def _overridden(module: nn.Module, attr: str, ours: object) -> Any:
    """``module``'s method ``attr`` as the swapped-in classes' ``ours`` overrides it: the
    one after the last class in the MRO that defines ours (a module can be both an owner
    and an FSDP module, and a later subclass, e.g. torch's parametrizations, sits above
    both)."""
    mro = type(module).__mro__
    last = max(i for i, cls in enumerate(mro) if cls.__dict__.get(attr) is ours)
    return getattr(super(mro[last], module), attr)


def _holder_groups(module: nn.Module) -> list[Any]:
    """The groups (``ParamGroup``) of the parameters ``module`` holds."""
    groups = {id(g): g for g in module.__dict__.get("_fsdp_holders", {}).values()}
    return list(groups.values())


def save_to_state_dict(self: nn.Module, destination: dict, prefix: str, keep_vars: bool) -> None:
    """``nn.Module._save_to_state_dict`` of the swapped-in classes: as FSDP2's state-dict
    pre-hook, reshards the module's groups first, so the state dict holds the sharded
    parameters (see [Note: registered parameters])."""
    for group in _holder_groups(self):
        group.reshard_registered()
    _overridden(self, "_save_to_state_dict", save_to_state_dict)(destination, prefix, keep_vars)


def load_from_state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> None:
    """``nn.Module._load_from_state_dict`` of the swapped-in classes: as FSDP2's
    load-state-dict pre-hook, reshards the module's groups first, so the sharded
    parameters are loaded into (see [Note: registered parameters])."""
    for group in _holder_groups(self):
        group.reshard_registered()
    _overridden(self, "_load_from_state_dict", load_from_state_dict)(*args, **kwargs)


def holder_methods() -> dict[str, Any]:
    """The methods every swapped-in class of a module holding sharded parameters
    overrides (an owner's, and an ``FSDP<cls>``'s)."""
    return {"register_parameter": register_parameter,
            "_save_to_state_dict": save_to_state_dict,
            "_load_from_state_dict": load_from_state_dict}


def owner_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a property per parameter name in ``names`` (cached per pair),
    :func:`register_parameter`, :func:`save_to_state_dict` and :func:`load_from_state_dict`."""
    key = (cls, names)
    if key not in _owner_classes:
        attrs = {name: param_property(name) for name in names}
        attrs.update(holder_methods())
        _owner_classes[key] = type(cls.__name__, (cls,), attrs)
    return _owner_classes[key]


