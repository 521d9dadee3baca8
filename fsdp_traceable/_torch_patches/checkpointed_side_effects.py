"""Dynamo's checkpoint higher-order op lets a checkpointed module that holds
``fully_shard``-ed modules change their state, and only such a module."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakSet

import torch.nn as nn

from .wrapping import wrap_once

MARKER = "_fsdp_traceable_allows_sharded"
# The modules a checkpoint wraps (a checkpoint_wrapper's inner module) that hold a
# fully_shard-ed module; filled by fully_shard when it links a root's groups.
_checkpointed_sharded: WeakSet[nn.Module] = WeakSet()


def allow_group_state_under_checkpoint(module: nn.Module) -> None:
    """Marks ``module``, the module a ``checkpoint_wrapper`` checkpoints, as holding
    ``fully_shard``-ed modules: see :func:`allow_checkpointed_group_state`."""
    _checkpointed_sharded.add(module)


def _checkpointed_module(function: Any) -> nn.Module | None:
    """The module a checkpoint's first argument (Dynamo's variable for it) calls: the
    module itself (``checkpoint_wrapper`` checkpoints its inner module) or the module of
    a bound method."""
    for candidate in (function, getattr(function, "obj", None)):
        value = getattr(candidate, "value", None)
        if isinstance(value, nn.Module):
            return value
    return None


def allow_checkpointed_group_state() -> bool:
    """Dynamo traces a checkpointed module that holds ``fully_shard``-ed modules (a
    sharded module inside a ``checkpoint_wrapper``) with the side effects of its forward
    allowed, as ``torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint``
    would, for that checkpoint only.

    Dynamo traces a checkpointed region as one higher-order op and refuses any change
    of Python state inside it ("HOP: Unsafe side effect"): eagerly, the recompute in
    backward would make the change again, the compiled recompute cannot. A group's
    traced forward binds its unsharded parameters to the module and unbinds them
    before it returns: nothing is left to redo in the recompute, which re-gathers the
    parameters from the graph's own collectives. Torch's switch for that is global and
    would also let a user's other checkpointed code drop its side effects silently, so
    it stays as the user set it; this wraps ``CheckpointHigherOrderVariable._call_function``
    so that a checkpoint whose function is (a method of) a module marked by
    :func:`allow_group_state_under_checkpoint` is traced as if the switch were on, and
    every other checkpoint as torch traces it.

    Applies to: torch 2.11 to 2.15 (``CheckpointHigherOrderVariable`` reads the switch
    into ``allow_side_effects``; ``tests/_torch_patches/test_checkpointed_side_effects.py``
    checks that unpatched Dynamo still refuses the sharded forward). Where torch lacks
    that class, nothing is changed.

    Returns:
        Whether the wrapper is in place.
    """
    try:
        from torch._dynamo.variables.higher_order_ops import CheckpointHigherOrderVariable
    except ImportError:
        return False

    def allow_for_sharded(current: Callable[..., Any]) -> Callable[..., Any]:
        def _call_function(self: Any, tx: Any, args: list, kwargs: dict) -> Any:
            module = _checkpointed_module(args[0]) if args else None
            if module is None or module not in _checkpointed_sharded:
                return current(self, tx, args, kwargs)
            before = self.allow_side_effects
            self.allow_side_effects = True
            try:
                return current(self, tx, args, kwargs)
            finally:
                self.allow_side_effects = before

        return _call_function

    return wrap_once(CheckpointHigherOrderVariable, "_call_function", MARKER, allow_for_sharded)
