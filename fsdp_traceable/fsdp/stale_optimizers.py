"""An optimizer built before ``fully_shard`` holds the parameters ``fully_shard`` replaced:
its steps would change nothing the model uses, silently (FSDP2 is as silent). Its first
step raises instead.

The check is torch's global optimizer step pre-hook, registered by the first
``fully_shard`` call (not at import). It looks at an optimizer's parameters once, at its
first step, and only for parameters ``fully_shard`` replaced; every later step of that
optimizer costs one set lookup.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

# Optimizers already looked at: process-wide, held weakly, holding no model.
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_replaced: Mapping[torch.nn.Parameter, object] | None = None


def watch(replaced: Mapping[torch.nn.Parameter, object]) -> None:
    """Makes every optimizer's first step check its parameters against ``replaced`` (the
    parameters ``fully_shard`` replaced, weakly held). Idempotent."""
    global _replaced
    if _replaced is None:
        _replaced = replaced
        register_optimizer_step_pre_hook(_check_first_step)


def is_stale_check(hook: object) -> bool:
    """Whether ``hook`` (a global optimizer step pre-hook) is this module's check, which
    code that runs an optimizer's update without ``step()`` calls itself (:func:`check`)."""
    return hook is _check_first_step


def check(optimizer: torch.optim.Optimizer) -> None:
    """Raises if ``optimizer`` holds a parameter ``fully_shard`` replaced (once per
    optimizer)."""
    if _replaced is None or optimizer in _checked:
        return
    _checked.add(optimizer)
    stale = sum(1 for group in optimizer.param_groups for param in group["params"]
                if param in _replaced)
    if stale:
        raise RuntimeError(
            f"{type(optimizer).__name__} holds {stale} parameter(s) that fully_shard replaced "
            "with sharded ones: it was built before fully_shard, so its steps would not change "
            "the model. Build the optimizer after fully_shard, from model.parameters()"
        )


def _check_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    check(optimizer)
