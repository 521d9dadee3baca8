"""``FSDPModule``: the methods every ``fully_shard``-ed module gains, and the class
swap that lets a module read its unsharded parameters during forward."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle
from torch.utils._pytree import tree_map

from ..collectives import comm
from . import module_settings, saved_unsharded
from .autograd_bridge import unshard_params
from .module_settings import check_bool, groups_of
from .param_group import ParamGroup

_fsdp_classes: dict[tuple[type, tuple[str, ...]], type] = {}
_owner_classes: dict[tuple[type, tuple[str, ...]], type] = {}


class FSDPModule(TorchFSDPModule):
    """Mixin added to every module passed to :func:`fully_shard`.

    A subclass of torch's ``FSDPModule``, so ``isinstance`` checks written for FSDP2
    (and ``register_fsdp_forward_method``) accept it; every torch method that would
    reach FSDP2's internal state is overridden here, by an implementation or by a
    clear ``NotImplementedError``.
    """

    # MRO: [FSDP<Orig>, this, torch's FSDPModule, Orig, ...]; torch's __new__ builds Orig.
    _orig_cls_mro_index: int = 3

    _fsdp_group: ParamGroup
    _fsdp_next_groups: list[ParamGroup]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters now (not recursive), as FSDP2's ``unshard``.

        The next forward of the module uses them and then reshards per
        ``reshard_after_forward``; :meth:`reshard` drops them earlier.

        Args:
            async_op: return a handle whose ``wait()`` finishes the unshard (the next
                forward also waits for it), instead of waiting here.

        Returns:
            An ``UnshardHandle`` if ``async_op``, else ``None``.
        """
        check_bool("async_op", async_op)
        group = self._fsdp_group
        handle = _UnshardHandle(group)
        if group.explicit_unsharded is not None or is_bound(group):
            handle = _UnshardHandle(None)
        elif async_op and not comm.use_traced_path():
            group.prefetch()
        else:
            handle.wait()
        return handle if async_op else None

    def reshard(self) -> None:
        """Frees the unsharded parameters of this module's group (not recursive)."""
        group = self._fsdp_group
        if group.explicit_unsharded is not None:
            group.explicit_unsharded = None
            unbind_unsharded(group)
        group.drop_unsharded()

    def reset_iter_state(self) -> None:
        """Reshards every group under this module and forgets partial forward/no-sync state."""
        for module in self.modules():
            if isinstance(module, FSDPModule):
                module.reshard()
                group = module._fsdp_group
                if group.shared_unsharded is not None:
                    release_shared(group)
                group.eager.accumulated_unsharded_grads = None

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (``False`` accumulates them unsharded).

        Args:
            requires_gradient_sync: ``False`` for all but the last microbatch.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        check_bool("requires_gradient_sync", requires_gradient_sync)
        for group in groups_of(self, recurse):
            group.requires_gradient_sync = requires_gradient_sync
            group.requires_all_reduce = requires_gradient_sync

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters re-gathered for backward once it finishes.

        Args:
            reshard_after_backward: ``False`` keeps them for the next forward, which then
                skips its all-gather (use only while the parameters do not change).
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        check_bool("reshard_after_backward", reshard_after_backward)
        for group in groups_of(self, recurse):
            group.reshard_after_backward = reshard_after_backward

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether backward re-gathers the parameters instead of keeping them from forward.

        Overrides the default (``True`` except for the root), as in FSDP2: ``True``
        on the root makes its backward re-gather too.

        Args:
            reshard_after_forward: free the unsharded parameters after forward.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        check_bool("reshard_after_forward", reshard_after_forward)
        for group in groups_of(self, recurse):
            group.reshard_after_forward = reshard_after_forward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: backward leaves no reduction pending to wait for."""
        check_bool("is_last_backward", is_last_backward)

    set_requires_all_reduce = module_settings.set_requires_all_reduce
    set_gradient_divide_factor = module_settings.set_gradient_divide_factor
    set_reduce_scatter_divide_factor = module_settings.set_reduce_scatter_divide_factor
    set_force_sum_reduction_for_comms = module_settings.set_force_sum_reduction_for_comms
    set_reduce_scatter_unused_params = module_settings.set_reduce_scatter_unused_params
    set_all_reduce_hook = module_settings.set_all_reduce_hook
    set_modules_to_forward_prefetch = module_settings.set_modules_to_forward_prefetch
    set_modules_to_backward_prefetch = module_settings.set_modules_to_backward_prefetch
    set_unshard_in_backward = module_settings.set_unshard_in_backward
    set_post_optim_event = module_settings.set_post_optim_event
    set_custom_all_gather = module_settings.set_custom_all_gather
    set_custom_reduce_scatter = module_settings.set_custom_reduce_scatter
    set_symm_mem_for_comm = module_settings.set_symm_mem_for_comm
    set_allocate_memory_from_process_group_for_comm = (
        module_settings.set_allocate_memory_from_process_group_for_comm)

    def _get_fsdp_state(self) -> ForwardHooks:
        """What torch's ``register_fsdp_forward_method`` wrapper calls around a method."""
        return self.__dict__["_fsdp_forward_hooks"]

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to()/to_empty() rebuild the parameters: reshard first, then re-read them.
        self.reshard()
        result = super(TorchFSDPModule, self)._apply(*args, **kwargs)
        self._fsdp_group.refresh_params()
        return result

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        args, kwargs, scope = pre_forward(self, args, kwargs)
        try:
            output = super().forward(*args, **kwargs)
        except BaseException:
            abort_forward(self, scope)
            raise
        return post_forward(self, scope, output)


def _unsupported(name: str) -> Callable[..., Any]:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FSDPModule.{name} is not supported by fsdp_traceable's fully_shard; see its "
            "docs/api.md for the supported methods (or use torch.distributed.fsdp.fully_shard)"
        )

    method.__name__ = name
    return method


# Every other method of torch's FSDPModule reads FSDP2's own state: fail clearly instead.
for _name, _value in vars(TorchFSDPModule).items():
    if callable(_value) and not _name.startswith("__") and _name not in vars(FSDPModule):
        setattr(FSDPModule, _name, _unsupported(_name))


class _UnshardHandle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is None or group.explicit_unsharded is not None or is_bound(group):
            return
        with torch.enable_grad():  # the forward that uses them may need their backward
            group.explicit_unsharded = unshard_params(group, recompute_in_backward=False)
        bind_unsharded(group, group.explicit_unsharded)


class ForwardScope(NamedTuple):
    """What one forward call took: the unsharded parameters it must release (``None``
    if another call owns them) and the saved-tensor hooks it entered."""

    unsharded: tuple[torch.Tensor, ...] | None
    hooks: Any


class ForwardHooks:
    """FSDP2's ``_pre_forward``/``_post_forward`` pair, for torch's
    ``register_fsdp_forward_method``; scopes nest as the methods do."""

    def __init__(self, module: nn.Module) -> None:
        self._scopes: list[ForwardScope] = []
        self._module = weakref.ref(module)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        args, kwargs, scope = pre_forward(module, args, kwargs)
        self._scopes.append(scope)
        return args, kwargs

    def _post_forward(self, module: nn.Module, args: tuple, output: Any) -> Any:
        return post_forward(module, self._scopes.pop(), output)

    # torch's share_comm_ctx reads one module's stream context and assigns it to the
    # others through these.
    @property
    def _comm_ctx(self) -> comm.DeviceStreams:
        return self._module()._fsdp_group.streams

    @_comm_ctx.setter
    def _comm_ctx(self, streams: comm.DeviceStreams) -> None:
        self._module()._fsdp_group.streams = streams

    @property
    def _fsdp_param_groups(self) -> list:
        return []  # share_comm_ctx's per-group assignment: done by the setter above


def pre_forward(module: FSDPModule, args: tuple, kwargs: dict) -> tuple[tuple, dict, ForwardScope]:
    """Casts the inputs and binds the group's unsharded parameters to its modules.

    The first forward of a pass gathers (or takes what ``unshard()`` gathered); a
    forward that runs while the parameters are bound (a registered forward method
    calling ``forward``, or the second module of a ``fully_shard([a, b])`` group)
    reuses them.
    """
    group = module._fsdp_group
    _check_input_device(module, group.device_type, args, kwargs)
    policy = group.mp_policy
    if policy.cast_forward_inputs and policy.param_dtype is not None:
        args, kwargs = _cast_floats((args, kwargs), policy.param_dtype)
    traced = comm.use_traced_path()
    if traced and (group.explicit_forward_prefetch or group.explicit_backward_prefetch):
        raise NotImplementedError(
            "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch schedule "
            "eager all-gathers; in a compiled graph Inductor places them "
            "(torch.compile(options=fsdp_traceable.inductor_options(overlap=True))). "
            "Pass [] to both setters before compiling"
        )
    shared = len(group.modules) > 1
    if group.explicit_unsharded is not None:
        unsharded = group.explicit_unsharded
        group.explicit_unsharded = None
    elif shared and group.shared_unsharded is not None:
        return args, kwargs, ForwardScope(None, _enter_hooks(group, traced))
    elif is_bound(group):
        return args, kwargs, ForwardScope(None, None)
    else:
        reshard = group.reshard_after_forward and torch.is_grad_enabled()
        unsharded = unshard_params(group, recompute_in_backward=reshard and traced)
        bind_unsharded(group, unsharded)
    if shared:
        group.shared_unsharded = unsharded
        group.modules_to_run = {id(m) for m in group.modules}
    if not traced:
        for child in module._fsdp_next_groups:
            if child.explicit_unsharded is None:  # unshard() already gathered it
                child.prefetch()
        if group.reshard_after_forward:
            saved_unsharded.register(group, list(unsharded))
        elif not group.reshard_after_backward and torch.is_grad_enabled():
            group.eager.forward_unsharded = tuple(unsharded)
    return args, kwargs, ForwardScope(unsharded, _enter_hooks(group, traced))


def post_forward(module: FSDPModule, scope: ForwardScope, output: Any) -> Any:
    """Releases what :func:`pre_forward` bound (per the group's pass) and casts the output."""
    group = module._fsdp_group
    if scope.hooks is not None:
        scope.hooks.__exit__(None, None, None)
    if len(group.modules) > 1:
        group.modules_to_run.discard(id(module))
        if not group.modules_to_run:
            release_shared(group)
    elif scope.unsharded is not None:
        _release(group, scope.unsharded)
    if group.is_root and scope.unsharded is not None:
        # FSDP2 ends the pass of groups whose modules did not all run at the root's end.
        for other in group.list_groups:
            if other.shared_unsharded is not None:
                release_shared(other)
    if group.mp_policy.output_dtype is not None:
        output = _cast_floats(output, group.mp_policy.output_dtype)
    return output


def abort_forward(module: FSDPModule, scope: ForwardScope) -> None:
    """Unbinds after a forward that raised, so the next call starts clean."""
    group = module._fsdp_group
    if scope.hooks is not None:
        scope.hooks.__exit__(None, None, None)
    if len(group.modules) > 1:
        release_shared(group)
    elif scope.unsharded is not None:
        _release(group, scope.unsharded)


def release_shared(group: ParamGroup) -> None:
    """Ends a ``fully_shard([a, b])`` group's forward pass."""
    unsharded, group.shared_unsharded = group.shared_unsharded, None
    group.modules_to_run = set()
    if unsharded is not None:
        _release(group, unsharded)


def _release(group: ParamGroup, unsharded: tuple[torch.Tensor, ...]) -> None:
    if not comm.use_traced_path() and group.reshard_after_forward:
        saved_unsharded.unregister(list(unsharded))
        # Parameters kept after a backward served this forward; like FSDP2, it
        # reshards them now and backward gathers again.
        group.eager.unsharded_for_backward = None
    unbind_unsharded(group)


def _enter_hooks(group: ParamGroup, traced: bool) -> Any:
    """Eager reshard-after-forward: autograd saves tokens for the unsharded parameters."""
    if traced or not group.reshard_after_forward:
        return None
    hooks = saved_unsharded.hooks()
    hooks.__enter__()
    return hooks


def is_bound(group: ParamGroup) -> bool:
    """Whether the group's unsharded parameters are bound to its modules right now."""
    if not group.bindings:
        return False
    owner, name, _ = group.bindings[0]
    return name in owner.__dict__["_fsdp_unsharded"]


def bind_unsharded(group: ParamGroup, unsharded: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
    unsharded = group.compute_params(unsharded)
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
    if issubclass(cls, FSDPModule):
        module.__dict__["_fsdp_forward_hooks"] = ForwardHooks(module)
    module.__class__ = cls


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
