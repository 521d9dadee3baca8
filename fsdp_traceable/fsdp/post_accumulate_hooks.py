"""A sharded parameter's post-accumulate-grad hooks run once per reduction, as FSDP2's.

[Note: post-accumulate-grad hooks in eager backward]
FSDP2 calls ``register_post_accumulate_grad_hook`` hooks of a sharded parameter after
its reduce-scatter writes ``.grad``, and autograd never does (its sharded parameters are
not in the autograd graph). Ours are (inputs of the group's ``UnshardParams``, so a
compiled backward can return sharded gradients through it), and autograd runs a leaf's
post-accumulate-grad hooks even when no gradient reaches it: an eager backward, whose
reduction writes ``.grad`` later (``reduce_queue``), would run them once too early,
before the reduction.
So the eager ``UnshardParams.backward`` empties each hook dict (:func:`hide`) before
autograd reaches the parameters, and the hooks come back (:func:`restore`) right before
the reduction writes ``.grad`` and runs them, or at the group's next forward (a no-sync
microbatch, which FSDP2 runs no hooks for either). The dict object is kept: autograd
holds it, and the handles a user holds remove from it.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

_HIDDEN = "_fsdp_traceable_hidden_post_accumulate_hooks"


def hide(params: Iterable[torch.Tensor]) -> bool:
    """Empties the post-accumulate-grad hook dict of each of ``params``, keeping the hooks.

    Returns:
        Whether any parameter had hooks.
    """
    hid = False
    for param in params:
        hooks = getattr(param, "_post_accumulate_grad_hooks", None)
        if hooks:
            hidden = param.__dict__.setdefault(_HIDDEN, {})
            hidden.update(hooks)
            hooks.clear()
            hid = True
    return hid


def restore(param: torch.Tensor) -> None:
    """Puts back the hooks :func:`hide` took, before any registered since."""
    hidden = param.__dict__.pop(_HIDDEN, None)
    if hidden:
        hooks = param._post_accumulate_grad_hooks
        later = dict(hooks)
        hooks.clear()
        hooks.update(hidden)
        hooks.update(later)
