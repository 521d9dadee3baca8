"""The error for torch's ``fully_shard`` (FSDP2) applied around modules ours sharded:
FSDP2's lazy init would take our state over with internals ours does not have, so the
state recognises that reader and raises :class:`MixedFullyShardError` (see [Note: torch's
FSDPState and ours] in module_state.py)."""

from __future__ import annotations

import sys

import torch.nn as nn


class MixedFullyShardError(RuntimeError):
    """torch's ``fully_shard`` (FSDP2) applied to a module that encloses modules sharded by
    ours: FSDP2's lazy init cannot drive them."""


def fsdp2_lazy_init_root(torch_state: type) -> nn.Module | None:
    """If FSDP2's lazy init (``torch_state._lazy_init``, torch's ``FSDPState``, of a torch
    ``fully_shard`` root) is what reads the state's attribute now: that root's module
    (else ``None``)."""
    lazy_init = getattr(torch_state, "_lazy_init", None)
    frame = sys._getframe(3)  # the caller of the state's property
    if lazy_init is None or frame.f_code is not lazy_init.__code__:
        return None
    modules = getattr(frame.f_locals.get("self"), "_modules", None)
    return modules[0] if modules else None


def mixed_error(torch_root: nn.Module | None, module: nn.Module | None) -> MixedFullyShardError:
    """The error of FSDP2's lazy init reaching the state of our ``module`` (``None``
    once it is gone): see [Note: torch's FSDPState and ours] in module_state.py."""
    ours = type(module).__name__ if module is not None else "a module"
    paths = [] if torch_root is None else [
        path for path, m in torch_root.named_modules() if m is module]
    ours = f"{paths[0]!r} ({ours})" if paths else ours
    enclosing = f" on {type(torch_root).__name__}" if torch_root is not None else ""
    return MixedFullyShardError(
        f"torch's fully_shard (FSDP2){enclosing} encloses {ours}, which "
        "fsdp_traceable's fully_shard sharded: FSDP2 cannot run modules sharded by "
        "fsdp_traceable. Apply fsdp_traceable's fully_shard to the enclosing modules "
        "too (from fsdp_traceable import fully_shard), not torch's"
    )
