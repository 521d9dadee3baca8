"""Which tensor a sharded module's parameter attribute reads: the sharded parameter,
or, while its group's unsharded parameters are bound (during forward), the unsharded one.

``fully_shard`` swaps each module holding parameters of a group for a subclass with
one property per such parameter (:func:`owner_class`); the property reads the module's
``_fsdp_unsharded`` dict first, which :func:`bind_unsharded` fills and
:func:`unbind_unsharded` empties.
"""

from __future__ import annotations

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
    """The ``register_parameter`` the swapped-in classes override: the one after the
    last class in the MRO that defines ours (a module can be both an owner and an
    FSDP module, and a later subclass, e.g. torch's parametrizations, sits above both)."""
    mro = type(module).__mro__
    last = max(i for i, cls in enumerate(mro)
               if cls.__dict__.get("register_parameter") is register_parameter)
    super(mro[last], module).register_parameter(name, param)


def owner_class(cls: type, names: tuple[str, ...]) -> type:
    """``cls`` with a property per parameter name in ``names`` (cached per pair), and
    :func:`register_parameter`."""
    key = (cls, names)
    if key not in _owner_classes:
        attrs = {name: param_property(name) for name in names}
        attrs["register_parameter"] = register_parameter
        _owner_classes[key] = type(cls.__name__, (cls,), attrs)
    return _owner_classes[key]


