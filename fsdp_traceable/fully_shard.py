"""``fully_shard``: FSDP2's API on top of the traceable collectives."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from . import comm, saved_unsharded
from .autograd_bridge import unshard_params
from .param_group import ParamGroup
from .shard_info import SUPPORTED_DTYPES

_fsdp_classes: dict[type, type] = {}
_owner_classes: dict[tuple[type, tuple[str, ...]], type] = {}
# The original (unsharded) parameters every fully_shard call replaced: a weight tied
# across two calls is still the original object in the module sharded second.
_replaced_params = WeakIdKeyDictionary()
# The sharded parameters fully_shard created: finding one again means a parent was
# sharded before its child.
_sharded_params = WeakIdKeyDictionary()


class FSDPModule:
    """Mixin added to every module passed to :func:`fully_shard`."""

    _fsdp_group: ParamGroup
    _fsdp_next_groups: list[ParamGroup]

    def unshard(self) -> None:
        """All-gathers this module's parameters now and keeps them until :meth:`reshard`."""
        group = self._fsdp_group
        group.explicit_unsharded = unshard_params(group, recompute_in_backward=False)
        _bind(group, group.explicit_unsharded)

    def reshard(self) -> None:
        """Frees the parameters gathered by :meth:`unshard`."""
        group = self._fsdp_group
        group.explicit_unsharded = None
        _unbind(group)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (``False`` accumulates them unsharded).

        Args:
            requires_gradient_sync: ``False`` for all but the last microbatch.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        _check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in _groups(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters re-gathered for backward once it finishes.

        Args:
            reshard_after_backward: ``False`` keeps them for the next forward, which then
                skips its all-gather (use only while the parameters do not change).
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        _check_bool("reshard_after_backward", reshard_after_backward)
        for group in _groups(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Whether backward re-gathers the parameters instead of keeping them from forward."""
        _check_bool("reshard_after_forward", reshard_after_forward)
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
        _bind(group, unsharded)
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
                _unbind(group)
        if policy.output_dtype is not None:
            output = _cast_floats(output, policy.output_dtype)
        return output


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    shard_placement_fn: Callable[[nn.Parameter], Shard | None] | None = None,
) -> nn.Module:
    """Shards ``module``'s parameters across ``mesh``; a drop-in for FSDP2's ``fully_shard``.

    Apply bottom-up (blocks first, then the root). The parameters of ``module`` not
    already managed by a ``fully_shard``-ed submodule form one group: one all-gather
    in forward, one reduce-scatter in backward. They become ``nn.Parameter``s
    wrapping ``DTensor``s laid out as FSDP2 lays them out.

    Args:
        module: the module to shard; its class is swapped for an ``FSDP<cls>`` subclass.
        mesh: a 1-D mesh (FSDP) or 2-D mesh with dims (replicate, shard) (HSDP);
            default: every rank on the default device.
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather them again in backward (the root module never does).
        mp_policy: the mixed-precision policy (torch's ``MixedPrecisionPolicy``).
        shard_placement_fn: maps a parameter to ``Shard(dim)`` (or ``None`` for ``Shard(0)``).

    Returns:
        ``module``, now also an :class:`FSDPModule`.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(
            f"fully_shard was already applied to this {type(module).__name__}; apply it once per module"
        )
    mesh = mesh if mesh is not None else _default_mesh()
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(
            f"mesh must be a 1-D DeviceMesh (FSDP) or a 2-D one with dims (replicate, shard) "
            f"(HSDP), got {getattr(mesh, 'ndim', type(mesh).__name__)}-D"
        )
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy")
    _check_mp_dtypes(mp_policy)
    _check_bool("reshard_after_forward", reshard_after_forward)
    owned = _managed_params(module)
    group = ParamGroup(
        [(fqn, param) for fqn, param, _ in owned], mesh,
        reshard_after_forward=reshard_after_forward, mp_policy=mp_policy,
        shard_placement_fn=shard_placement_fn,
    )
    for _, param, _ in owned:
        _replaced_params[param] = True
    for sharded in group.sharded_params:
        _sharded_params[sharded] = True
    group.device_type = mesh.device_type
    group.explicit_unsharded = None
    group.bindings = []
    by_param: dict[int, nn.Parameter] = {}
    for (fqn, param, owners), sharded in zip(owned, group.sharded_params):
        by_param[id(param)] = sharded
        for owner, name in owners:
            owner._parameters[name] = sharded
    index = {id(p): i for i, p in enumerate(group.sharded_params)}
    owner_names: dict[int, tuple[nn.Module, list[str]]] = {}
    for fqn, param, owners in owned:
        for owner, name in owners:
            group.bindings.append((owner, name, index[id(by_param[id(param)])]))
            owner_names.setdefault(id(owner), (owner, []))[1].append(name)
    for owner, names in owner_names.values():
        if owner is not module:
            _swap_class(owner, _owner_class(type(owner), tuple(names)))
    _swap_class(module, _fsdp_class(type(module), tuple(owner_names.get(id(module), (None, []))[1])))
    module._fsdp_group = group
    _link_groups(module)
    return module


def _managed_params(module: nn.Module) -> list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]:
    """``(fqn, param, [(owner, name), ...])`` for each parameter this call manages."""
    managed: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    sharded_elsewhere: set[int] = set()
    for sub in module.modules():
        if sub is not module and isinstance(sub, FSDPModule):
            sharded_elsewhere.update(id(p) for p in sub.parameters())
    for prefix, owner in _modules_outside_fsdp(module):
        for name, param in owner._parameters.items():
            if param is None:
                continue
            fqn = f"{prefix}{name}"
            if param in _sharded_params:
                raise ValueError(
                    f"parameter {fqn!r} was already sharded by fully_shard on a parent "
                    "module; apply fully_shard bottom-up: submodules first, then their "
                    "parents, the root last"
                )
            if isinstance(param, DTensor):
                raise ValueError(
                    f"parameter {fqn!r} is already a DTensor (placements "
                    f"{tuple(param.placements)}); fully_shard shards plain parameters: "
                    "apply it to the module before any other sharding"
                )
            if id(param) in sharded_elsewhere or param in _replaced_params:
                raise ValueError(
                    f"parameter {fqn!r} is shared with a module that fully_shard already "
                    "sharded; apply fully_shard to a common ancestor of every module that "
                    "uses it (shared parameters must be in one group)"
                )
            if not param.is_floating_point():
                raise TypeError(
                    f"parameter {fqn!r} has dtype {param.dtype}; fully_shard shards floating-"
                    "point parameters only (register integer state as a buffer)"
                )
            managed.setdefault(id(param), (fqn, param, []))[2].append((owner, name))
    params = list(managed.values())
    by_device = {param.device.type: fqn for fqn, param, _ in params}
    if len(by_device) > 1:
        listed = ", ".join(f"{fqn!r} on {device}" for device, fqn in sorted(by_device.items()))
        raise ValueError(
            f"module has parameters on several device types ({listed}); move the module "
            "to one device before fully_shard (e.g. module.to('cpu'))"
        )
    if "meta" in by_device:
        raise ValueError(
            f"parameter {by_device['meta']!r} is on the meta device; fully_shard shards "
            "materialized parameters: call module.to_empty(device=...) and initialize the "
            "parameters before fully_shard"
        )
    by_dtype = {param.dtype: fqn for fqn, param, _ in params if param.requires_grad}
    if len(by_dtype) > 1:
        listed = ", ".join(f"{fqn!r} is {dtype}" for dtype, fqn in by_dtype.items())
        raise ValueError(
            f"trainable parameters of one fully_shard group have several dtypes ({listed}); "
            "their gradients are reduced in one bucket of one dtype: give them one dtype "
            "(e.g. module.float(); use mp_policy for lower-precision compute), or apply "
            "fully_shard to the submodules of each dtype separately"
        )
    return params


def _modules_outside_fsdp(module: nn.Module, prefix: str = ""):
    """``(prefix, submodule)`` for ``module`` and every submodule not under another
    ``fully_shard``, children before their parent: FSDP2's order, so a bucket's layout,
    and with it the reduce-scatter's summation order per element, matches FSDP2's."""
    for name, child in module._modules.items():
        if child is None or isinstance(child, FSDPModule):
            continue
        yield from _modules_outside_fsdp(child, f"{prefix}{name}.")
    yield prefix, module


def _bind(group: ParamGroup, unsharded: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    for owner, name, i in group.bindings:
        owner.__dict__["_fsdp_unsharded"][name] = unsharded[i]


def _unbind(group: ParamGroup) -> None:
    for owner, name, _ in group.bindings:
        owner.__dict__["_fsdp_unsharded"].pop(name, None)


def _param_property(name: str) -> property:
    def get(self: nn.Module) -> torch.Tensor:
        unsharded = self.__dict__["_fsdp_unsharded"].get(name)
        return unsharded if unsharded is not None else self._parameters[name]

    return property(get)


def _owner_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _owner_classes:
        attrs = {name: _param_property(name) for name in names}
        _owner_classes[key] = type(cls.__name__, (cls,), attrs)
    return _owner_classes[key]


def _fsdp_class(cls: type, names: tuple[str, ...]) -> type:
    key = (cls, names)
    if key not in _fsdp_classes:
        attrs = {name: _param_property(name) for name in names}
        _fsdp_classes[key] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
    return _fsdp_classes[key]


def _swap_class(module: nn.Module, cls: type) -> None:
    module.__dict__.setdefault("_fsdp_unsharded", {})
    module.__class__ = cls


def _groups(module: FSDPModule, recurse: bool) -> list[ParamGroup]:
    if not recurse:
        return [module._fsdp_group]
    return [m._fsdp_group for m in module.modules() if isinstance(m, FSDPModule)]


def _link_groups(root: FSDPModule) -> None:
    """Makes ``root`` (the latest ``fully_shard`` call, applied bottom-up) the root.

    The root group never reshards after forward: its backward starts right after.
    The groups' module order (pre-order, i.e. forward order for the usual
    blocks-in-sequence models) drives the eager prefetch: each group's forward
    prefetches the next group, each group's backward the previous one. Doing this
    at ``fully_shard`` time, not lazily in the first forward, keeps the compiled
    forward free of first-call branches (and their recompile).
    """
    fsdp_modules = [m for m in root.modules() if isinstance(m, FSDPModule)]
    for m in fsdp_modules:
        m._fsdp_group.is_root = m is root
    groups = [m._fsdp_group for m in fsdp_modules]
    for i, m in enumerate(fsdp_modules):
        m._fsdp_next_groups = groups[i + 1 : i + 2]
        previous = groups[i - 1] if i > 1 else None
        m._fsdp_group.prefetch_backward = previous.prefetch if previous is not None else None


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def _check_mp_dtypes(mp_policy: MixedPrecisionPolicy) -> None:
    """Rejects policy dtypes the collectives cannot carry, before any parameter is read."""
    supported = ", ".join(map(str, SUPPORTED_DTYPES))
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"mp_policy.{field}={dtype} is not supported: use one of {supported}, or "
                "None to keep each parameter's own dtype"
            )
    output_dtype = mp_policy.output_dtype
    if output_dtype is not None and not (
        isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point
    ):
        raise TypeError(
            f"mp_policy.output_dtype={output_dtype} is not a floating-point dtype: use "
            "e.g. torch.float32, or None to leave the outputs as computed"
        )


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


def _default_mesh() -> DeviceMesh:
    if not torch.distributed.is_initialized():
        raise ValueError(
            "fully_shard needs an initialized process group when mesh is None: call "
            "torch.distributed.init_process_group first, or pass mesh="
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (torch.distributed.get_world_size(),))
