"""Around a ``fully_shard``-ed module's forward: the record of what one forward call
took, and what the forward does to its inputs and output (the device check, the
mixed-precision casts).

The forward itself is the group's: ``ParamGroup.pre_forward`` / ``post_forward``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils._pytree import tree_map


class ForwardScope(NamedTuple):
    """What one forward call took: the unsharded parameters it must release (``None``
    if another call owns them), the saved-tensor hooks it entered, and whether those
    parameters are bound to the modules (a forward region binds its own)."""

    unsharded: tuple[torch.Tensor, ...] | None
    hooks: Any
    bound: bool = True


def prepare_inputs(module: nn.Module, args: tuple, kwargs: dict, device_type: str,
                   mp_policy: MixedPrecisionPolicy) -> tuple[tuple, dict]:
    """Checks a forward's inputs and casts them.

    Args:
        module: the module whose forward starts.
        args: its positional arguments.
        kwargs: its keyword arguments.
        device_type: the device type its parameters are sharded on.
        mp_policy: its group's mixed-precision policy.

    Returns:
        ``args`` and ``kwargs``, cast to ``param_dtype`` per ``mp_policy``.
    """
    check_input_device(module, device_type, args, kwargs)
    if mp_policy.cast_forward_inputs and mp_policy.param_dtype is not None:
        args, kwargs = cast_floats((args, kwargs), mp_policy.param_dtype)
    return args, kwargs


def check_input_device(module: nn.Module, device_type: str, args: tuple, kwargs: dict) -> None:
    """Raises if the first tensor argument is not on the mesh's device type.

    Runs before the all-gather, so a misplaced input fails on every rank without a
    collective. Under compile the device is static, so this adds no graph break.
    """
    # zip(range()), not enumerate(): Dynamo traces enumerate's polyfill per item.
    for key, value in (*zip(range(len(args)), args), *kwargs.items()):
        if isinstance(value, torch.Tensor):
            if value.device.type != device_type:
                where = f"argument {key}" if isinstance(key, int) else f"argument {key!r}"
                raise RuntimeError(  # torch's type for a device mismatch, as FSDP2 gets
                    f"{type(module).__name__}.forward got {where} on {value.device.type}, but "
                    f"its parameters are sharded on {device_type}: move the inputs to "
                    f"{device_type} before calling the model"
                )
            return


def cast_floats(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype``."""
    def cast(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)
