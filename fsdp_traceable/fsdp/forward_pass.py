"""One forward of a ``fully_shard``-ed module: the unsharded parameters bound before
it and released after it, input and output casts, and the saved-tensor hooks of eager
reshard-after-forward.

:class:`~.fsdp_module.FSDPModule`'s ``forward`` and torch's
``register_fsdp_forward_method`` (through :class:`ForwardHooks`) both run it.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..collectives import comm
from ..profiler_labels import phase
from .autograd_bridge import unshard_params
from .unsharded_binding import bind_unsharded, is_bound, unbind_unsharded

if TYPE_CHECKING:
    from .fsdp_module import FSDPModule
    from .param_group import ParamGroup

log = logging.getLogger(__name__)


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
    with phase("pre_forward", module._fsdp_group.name):
        return _pre_forward(module, args, kwargs)


def _pre_forward(module: FSDPModule, args: tuple, kwargs: dict) -> tuple[tuple, dict, ForwardScope]:
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
            group.root_state.saved_unsharded.register(group, list(unsharded))
        elif torch.is_grad_enabled() and group.has_trainable_params:
            # Its backward (reduce_grads) reshards them, or keeps them for the next
            # forward; until then forwards reuse them, as FSDP2's unsharded group.
            group.keep_forward_unsharded(unsharded)
    return args, kwargs, ForwardScope(unsharded, _enter_hooks(group, traced))


def post_forward(module: FSDPModule, scope: ForwardScope, output: Any) -> Any:
    """Releases what :func:`pre_forward` bound (per the group's pass) and casts the output."""
    with phase("post_forward", module._fsdp_group.name):
        return _post_forward(module, scope, output)


def _post_forward(module: FSDPModule, scope: ForwardScope, output: Any) -> Any:
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
    if comm.use_traced_path():
        unbind_unsharded(group)
        return
    if log.isEnabledFor(logging.DEBUG):
        log.debug("group %r after forward: %s", group.name,
                  "reshard (backward re-gathers)" if group.reshard_after_forward
                  else "keep the unsharded parameters for backward")
    if not group.reshard_after_forward:
        unbind_unsharded(group)
        return
    with phase("reshard", group.name):
        group.root_state.saved_unsharded.unregister(list(unsharded))
        # Parameters kept after a backward served this forward; like FSDP2, it
        # reshards them now and backward gathers again.
        group.eager.unsharded_for_backward = None
        unbind_unsharded(group)


def _enter_hooks(group: ParamGroup, traced: bool) -> Any:
    """Eager reshard-after-forward: autograd saves tokens for the unsharded parameters."""
    if traced or not group.reshard_after_forward:
        return None
    hooks = group.root_state.saved_unsharded.hooks()
    hooks.__enter__()
    return hooks


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
