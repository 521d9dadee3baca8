"""``FSDPModule``: the methods every ``fully_shard``-ed module gains, and the class
swap that lets a module read its unsharded parameters during forward."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..collectives import comm
from . import saved_unsharded
from .autograd_bridge import unshard_params
from .param_group import ParamGroup

_fsdp_classes: dict[type, type] = {}
_owner_classes: dict[tuple[type, tuple[str, ...]], type] = {}


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard`."""

    _fsdp_group: ParamGroup
    _fsdp_next_groups: list[ParamGroup]

    def unshard(self) -> None:
        """All-gathers this module's parameters now and keeps them until :meth:`reshard`."""
        group = self._fsdp_group
        group.explicit_unsharded = unshard_params(group, recompute_in_backward=False)
        bind_unsharded(group, group.explicit_unsharded)

    def reshard(self) -> None:
        """Frees the parameters gathered by :meth:`unshard`."""
        group = self._fsdp_group
        group.explicit_unsharded = None
        unbind_unsharded(group)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (``False`` accumulates them unsharded).

        Args:
            requires_gradient_sync: ``False`` for all but the last microbatch.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in _groups(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters re-gathered for backward once it finishes.

        Args:
            reshard_after_backward: ``False`` keeps them for the next forward, which then
                skips its all-gather (use only while the parameters do not change).
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        check_bool("reshard_after_backward", reshard_after_backward)
        for group in _groups(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether backward re-gathers the parameters instead of keeping them from forward."""
        check_bool("reshard_after_forward", reshard_after_forward)
        for group in _groups(self, recurse):
            group.reshard_after_forward = reshard_after_forward

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        group = self._fsdp_group
        _check_input_device(self, group.device_type, args, kwargs)
        policy = group.mp_policy
        if policy.cast_forward_inputs and policy.param_dtype is not None:
            args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
        traced = comm.use_traced_path()
        if group.explicit_unsharded is not None:
            unsharded = group.explicit_unsharded
        else:
            reshard = group.reshard_after_forward and torch.is_grad_enabled()
            unsharded = unshard_params(group, recompute_in_backward=reshard and traced)
        bind_unsharded(group, unsharded)
        if not traced:
            for child in self._fsdp_next_groups:
                if child.explicit_unsharded is None:  # unshard() already gathered it
                    child.prefetch()
        keep_saved = traced or not group.reshard_after_forward or group.explicit_unsharded is not None
        try:
            if keep_saved:
                output = super().forward(*args, **kwargs)
            else:
                saved_unsharded.register(group, list(unsharded))
                try:
                    with saved_unsharded.hooks():
                        output = super().forward(*args, **kwargs)
                finally:
                    saved_unsharded.unregister(list(unsharded))
        finally:
            if group.explicit_unsharded is None:
                unbind_unsharded(group)
        if policy.output_dtype is not None:
            output = _cast_floats(output, policy.output_dtype)
        return output


def bind_unsharded(group: ParamGroup, unsharded: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    for owner, name, i in group.bindings:
        owner.__dict__["_fsdp_unsharded"][name] = unsharded[i]


def unbind_unsharded(group: ParamGroup) -> None:
    for owner, name, _ in group.bindings:
        owner.__dict__["_fsdp_unsharded"].pop(name, None)


def _param_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        unsharded = self.__dict__["_fsdp_unsharded"].get(name)
        return unsharded if unsharded is not None else self._parameters[name]

    return property(get)


def owner_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _owner_classes:
        attrs = {name: _param_property(name) for name in names}
        _owner_classes[key] = type(cls.__name__, (cls,), attrs)
    return _owner_classes[key]


def fsdp_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _fsdp_classes:
        attrs = {name: _param_property(name) for name in names}
        _fsdp_classes[key] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
    return _fsdp_classes[key]


def swap_class(module: nn.Module, cls: type) -> None:
    module.__dict__.setdefault("_fsdp_unsharded", {})
    module.__class__ = cls


def _groups(module: FSDPModule, recurse: bool) -> list[ParamGroup]:
    if not recurse:
        return [module._fsdp_group]
    return [m._fsdp_group for m in module.modules() if isinstance(m, FSDPModule)]


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_input_device(module: nn.Module, device_type: str, args: tuple, kwargs: dict) -> None:
    """Raises if the first tensor argument is not on the mesh's device type.

    Runs before the all-gather, so a misplaced input fails on every rank without a
    collective. Under compile the device is static, so this adds no graph break.
    """
    for key, value in (*enumerate(args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            if value.device.type != device_type:
                where = f"argument {key}" if isinstance(key, int) else f"argument {key!r}"
                raise ValueError(
                    f"{type(module).__name__}.forward got {where} on {value.device.type}, but "
                    f"its parameters are sharded on {device_type}: move the inputs to "
                    f"{device_type} before calling the model"
                )
            return


def _cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
