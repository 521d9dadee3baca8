"""Argument checks and FSDP2 comm look-ups behind ``FSDPModule``'s setters.

Plain functions of their arguments: the setters themselves are methods in
:mod:`.fsdp_module`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from .param_group import ParamGroup


def check_bool(name: str, value: object) -> None:
    """Raises ``TypeError`` unless ``value`` (the argument ``name``) is a bool."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def check_fsdp_modules(modules: Any, fsdp_module_cls: type) -> list[nn.Module]:
    """``modules`` as a list, if it is a list of ``fsdp_module_cls`` instances (our
    ``FSDPModule``: a prefetch setter's argument)."""
    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        if not isinstance(module, fsdp_module_cls):
            raise ValueError(
                f"Expects FSDPModule but got {type(module).__name__}: pass modules "
                "fsdp_traceable.fully_shard was applied to"
            )
    return list(modules)


def check_comm(comm: Any, name: str) -> Any:
    """``comm`` if it implements FSDP2's comm interface (``allocate`` and ``__call__``)."""
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{name} must implement FSDP2's comm interface (allocate() and __call__), got "
            f"{type(comm).__name__}"
        )
    return comm


def fsdp2_comms(*names: str) -> list[type]:
    """FSDP2's comm classes ``names`` (from ``_fsdp_collectives``), or a clear error
    naming the ones this torch lacks."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    missing = [name for name in names if not hasattr(_fsdp_collectives, name)]
    if missing:
        raise NotImplementedError(
            f"this setter uses FSDP2's {', '.join(missing)}, which torch {torch.__version__} "
            "does not have; upgrade torch"
        )
    return [getattr(_fsdp_collectives, name) for name in names]


def check_no_custom_comm(groups: list[ParamGroup], method: str, allowed: tuple[type, ...]) -> None:
    """Raises if a group has a custom comm ``method`` would replace (other than ``allowed``)."""
    for group in groups:
        for comm, setter in ((group.settings.all_gather_comm, "set_custom_all_gather"),
                             (group.settings.reduce_scatter_comm, "set_custom_reduce_scatter")):
            if comm is not None and not isinstance(comm, allowed):
                raise ValueError(
                    f"{method}() replaces the comm that {setter}() set "
                    f"({type(comm).__name__}); FSDP2 does not combine them either: use one"
                )


def prefetch_all(groups: list[ParamGroup]) -> Callable[[], None]:
    """A function issuing the eager all-gathers of ``groups``, in order."""
    def prefetch() -> None:
        for group in groups:
            group.prefetch()

    return prefetch


def check_no_sync_eager(groups: list[ParamGroup]) -> None:
    """Raises ``NotImplementedError`` if a group's module was compiled by itself before
    ``fully_shard`` (``module.compile()`` then ``fully_shard``): its graph holds the
    group's collectives, and its compiled backward was traced with gradient sync on and
    reduce-scatters on every backward, so
    ``set_requires_gradient_sync(False)`` (which torch's pipeline schedules call before
    every microbatch's backward) would otherwise be ignored without a word."""
    if torch.compiler.is_compiling():
        return
    for group in groups:
        if group.compiled_on_its_own():
            raise NotImplementedError(
                f"set_requires_gradient_sync(False) with the module of group {group.name!r} "
                f"(parameters {group.params.fqns[:3]}) compiled by itself before fully_shard "
                "(module.compile() then fully_shard): its compiled backward reduce-scatters "
                "on every backward and cannot keep unsharded gradients. Call "
                "module.compile() after fully_shard instead (it compiles the module's "
                "compute and leaves the collectives eager, as FSDP2), or run these modules "
                "eagerly while accumulating without sync (docs/api.md, the no-sync "
                "workaround)"
            )
