"""The package's whole-step graph passes in torch's compile cache keys.

[Note: graph passes in the cache key]
The package's passes over the graph AOTAutograd traces of a whole step (the completion
of torch's forward-loss-backward recompute pass, which runs the region schedule's
passes: ``_torch_patches.complete_whole_step_recompute``) run after AOTAutograd's cache
lookup, and what they do is in neither AOTAutograd's cache key (which hashes Dynamo's
graph) nor Inductor's FX graph key. So a warm cache would serve a step compiled before
a change to them, or without them. Both keys hash ``torch.compiler.config.cache_key_tag``
(torch 2.11 to 2.15): a whole step compiles with a tag naming the hash of the passes'
source files, the user's own tag kept in front. :func:`fsdp_traceable.compile_step`
sets it around each call (:func:`keyed_by_graph_passes`); a whole step compiled plainly
(``trace_autograd_ops``, then ``torch.compile``) sets it from the moment Dynamo traces
its first ``fully_shard`` forward, before either key is computed, to the end of that
compile (:func:`key_this_compile_by_graph_passes`, from
``fsdp/traced_step_passes.py``). Both paths give one step the same keys.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any

import torch

# The files whose code runs in the passes (``_torch_patches``'s wrap of torch's
# recompute pass, and the region schedule and FX helpers it calls).
_GRAPH_PASS_FILES = (os.path.join("whole_step", "region_schedule.py"), "fx_ops.py",
                     os.path.join("_torch_patches", "whole_step_recompute.py"))
_TAG_PREFIX = "fsdp_traceable-graph-passes-"


@functools.cache
def graph_passes_hash() -> str:
    """A hash of the passes' source files (16 hex digits)."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = tuple(os.path.join(package, name) for name in _GRAPH_PASS_FILES)
    return get_hash_for_files(paths).hex()[:16]


def _config() -> Any | None:
    """``torch.compiler.config`` where it has ``cache_key_tag``, else ``None``."""
    config = getattr(torch.compiler, "config", None)
    return config if hasattr(config, "cache_key_tag") else None


def tagged(user_tag: str) -> str:
    """The cache key tag a whole step compiles with, ``user_tag`` (if any) kept first.

    Args:
        user_tag: ``torch.compiler.config.cache_key_tag`` as the user set it.

    Returns:
        ``user_tag`` itself where it names the passes already.
    """
    tag = f"{_TAG_PREFIX}{graph_passes_hash()}"
    if tag in user_tag.split("/"):
        return user_tag
    return f"{user_tag}/{tag}" if user_tag else tag


def keyed_by_graph_passes() -> contextlib.AbstractContextManager:
    """Torch's compile caches keyed by the package's graph passes too, within the
    context (see [Note: graph passes in the cache key])."""
    config = _config()
    if config is None:
        return contextlib.nullcontext()
    return config.patch(cache_key_tag=tagged(config.cache_key_tag))


# The user's tag, while the compile Dynamo runs holds the passes' tag: put back as it ends.
_users_tag: list[str] = []


def _restore_at_compile_end(args: object) -> None:
    if _users_tag:
        _config().cache_key_tag = _users_tag.pop()


def _restore_at_compile_end_registered() -> None:
    # Again after torch._dynamo.reset(), which drops every callback.
    handler = torch._dynamo.callback_handler
    if _restore_at_compile_end not in handler.end_callbacks:
        handler.register_end_callback(_restore_at_compile_end)


def key_this_compile_by_graph_passes() -> bool:
    """Keys the compile Dynamo runs now by the package's graph passes, to its end (called
    while Dynamo traces a ``fully_shard`` forward; see [Note: graph passes in the cache
    key]). Nothing where the tag names them already (:func:`fsdp_traceable.compile_step`).

    Returns:
        Whether the compile is keyed by them (``False`` where this torch has no
        ``cache_key_tag`` or no compile-end callback).
    """
    config = _config()
    if config is None or not hasattr(torch._dynamo, "callback_handler"):
        return False
    user_tag = config.cache_key_tag
    tag = tagged(user_tag)
    if tag != user_tag:
        # Torch's end callbacks run as its outermost compile ends, failed or not.
        _restore_at_compile_end_registered()
        _users_tag[:] = [user_tag]
        config.cache_key_tag = tag
    return True
