"""Compiled autograd, with each chosen AOT backward pasted as one region call.

Compiled autograd reads every AOT backward it pastes through
``torch._dynamo.compiled_autograd.extract_bw_module``; :func:`install` has it read
them through :func:`_outline_if_picked` (the patch itself is
:func:`fsdp_traceable._torch_patches.rewrite_aot_backwards`), so the graphs a
predicate picks come back outlined
(:func:`~fsdp_traceable.backward_regions.outline.outline`). No public torch hook
exists for this: where torch lacks the function (or ``nested_compile_region``)
nothing is installed and compiled autograd pastes as before.
``fsdp_traceable.config.backward_regions = False`` turns the rewrite off.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.fx as fx

from .. import _torch_patches, config
from .outline import outline

__all__ = ["install", "supported"]

# The rules that pick graphs, each added once by its installer (e.g. one module function
# for every fully_shard model): process-wide, as the hook is, and holding no model.
# A rule gets the compiled function (a class) and its backward graph.
_predicates: list[Callable[[type, fx.GraphModule], bool]] = []
# Per AOT compiled function (a class): its outlined backward, or None if not outlined.
# Keyed by the class, not the graph: after an AOTAutograd cache hit every read
# deserializes a new graph, and all the calls of one compiled block must share one
# region function for Dynamo to reuse its trace. Process-wide on purpose: identical
# blocks of two models run one compiled function (Dynamo caches per code object), and
# share its region. Held weakly: an entry goes with its compiled function.
_outlined: WeakKeyDictionary[type, fx.GraphModule | None] = WeakKeyDictionary()


def supported() -> bool:
    """Whether this torch's compiled autograd can take outlined backwards."""
    return (_torch_patches.extract_bw_module_exists()
            and hasattr(torch.compiler, "nested_compile_region"))


def _outline_if_picked(compiled_function: Any, bw_module: fx.GraphModule) -> fx.GraphModule:
    """The backward compiled autograd pastes for ``compiled_function``: outlined if a
    predicate picks it (judged once per compiled function), else ``bw_module``."""
    if not config.backward_regions:
        return bw_module
    if compiled_function not in _outlined:
        picked = any(predicate(compiled_function, bw_module) for predicate in _predicates)
        _outlined[compiled_function] = outline(bw_module) if picked else None
    outlined = _outlined[compiled_function]
    return outlined if outlined is not None else bw_module


def install(should_outline: Callable[[type, fx.GraphModule], bool]) -> bool:
    """Outline, from now on, the AOT backwards ``should_outline`` accepts.

    Args:
        should_outline: called once per compiled function, with the function (the
            AOT ``CompiledFunction`` class) and its backward graph.

    Returns:
        Whether the rewrite is in place (``False`` on a torch without the hook).
    """
    if not supported():
        return False
    _torch_patches.rewrite_aot_backwards(_outline_if_picked)
    if should_outline not in _predicates:
        _predicates.append(should_outline)
    return True
