"""The class swap that makes a module an ``FSDPModule``: ``FSDP<cls>`` with a property
per sharded parameter, so the module reads its unsharded parameters during forward.
"""

from __future__ import annotations

import torch.nn as nn

from .features.module_compile import adopt_compiled_call
from .fsdp_module import FSDPModule
from .module_state import entry_of, is_sharded
from .unsharded_binding import holder_methods, param_property

# The classes swapped in, per (module class, parameter names): process-wide, as FSDP2's
# per-class cache. They hold no model state (the unsharded parameters live in each
# module's __dict__), their number is bounded by the program's module classes, and two
# models of one architecture must get the same classes: Dynamo guards on a module's
# type, so a class per model would recompile every block of every new model.
_fsdp_classes: dict[tuple[type, tuple[str, ...]], type] = {}


def fsdp_class(cls: type, names: tuple[str, ...]) -> type:
    """``FSDP<cls>``: :class:`FSDPModule` and ``cls``, with a property per parameter
    name in ``names`` (cached per pair)."""
    key = (cls, names)
    if key not in _fsdp_classes:
        attrs = {name: param_property(name) for name in names}
        attrs.update(holder_methods())
        attrs["__deepcopy__"] = _deepcopy_unsupported
        _fsdp_classes[key] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
    return _fsdp_classes[key]


def _deepcopy_unsupported(module: nn.Module, memo: dict) -> None:
    """``copy.deepcopy`` of a sharded module (or a model holding one) raises, as FSDP2."""
    raise AssertionError(
        f"FSDP does not support deepcopy: {type(module).__name__} is sharded by "
        "fully_shard. Please use state dict for serialization, or deepcopy the model "
        "before fully_shard and shard the copy"
    )


def swap_class(module: nn.Module, cls: type) -> None:
    """Makes ``module`` an instance of ``cls`` (from :func:`fsdp_class` or ``owner_class``);
    an ``FSDPModule``'s entry (``register_state``) is built already."""
    module.__dict__.setdefault("_fsdp_unsharded", {})  # see [Note: a module's own entry]
    module.__class__ = cls
    if issubclass(cls, FSDPModule):
        compiled = adopt_compiled_call(module, module._fsdp_compute, is_sharded)
        if compiled is not None:  # see [Note: per-module compile]
            entry_of(module).compiled_compute = compiled
