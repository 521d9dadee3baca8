"""Eager reshard-after-forward: autograd saves a token, not the unsharded parameter.

While a group's forward runs, a ``saved_tensors_hooks`` pack hook replaces every
saved tensor that lives in one of the group's unsharded parameters (the parameter or
a view of it) with ``(group, index, view geometry)``. The unpack hook asks the group
for its parameters again, which all-gathers them once for the whole backward of the
group, and rebuilds the view. The unsharded parameters are therefore freed as soon
as forward no longer references them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .param_group import ParamGroup

# storage data_ptr -> (group, parameter index) of every unsharded parameter alive in
# an eager forward that reshards after forward.
_live_unsharded: dict[int, tuple[ParamGroup, int, torch.dtype]] = {}


class _SavedUnshardedView(NamedTuple):
    group: ParamGroup
    index: int
    size: torch.Size
    stride: tuple[int, ...]
    storage_offset: int


# A wrapper subclass (an all-gather extension's unsharded parameter) has no storage of
# its own to match: autograd saves it as it is.
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _has_own_storage(tensor: torch.Tensor) -> bool:
    return tensor.numel() > 0 and type(tensor) in _PLAIN


def register(group: ParamGroup, unsharded: list[torch.Tensor]) -> None:
    for index, tensor in enumerate(unsharded):
        if _has_own_storage(tensor):
            _live_unsharded[tensor.untyped_storage().data_ptr()] = (group, index, tensor.dtype)


def unregister(unsharded: list[torch.Tensor]) -> None:
    for tensor in unsharded:
        if _has_own_storage(tensor):
            _live_unsharded.pop(tensor.untyped_storage().data_ptr(), None)


def _pack(tensor: torch.Tensor) -> object:
    # Runs for every tensor autograd saves: the common miss costs one storage lookup.
    if type(tensor) not in _PLAIN or tensor.layout != torch.strided:
        return tensor
    entry = _live_unsharded.get(tensor.untyped_storage().data_ptr())
    if entry is None or entry[2] != tensor.dtype or tensor.numel() == 0:
        return tensor
    group, index, _ = entry
    return _SavedUnshardedView(
        group, index, tensor.size(), tensor.stride(), tensor.storage_offset()
    )


def _unpack(saved: object) -> torch.Tensor:
    if not isinstance(saved, _SavedUnshardedView):
        return saved
    base = saved.group.unsharded_for_backward()[saved.index]
    return base.as_strided(saved.size, saved.stride, saved.storage_offset)


def hooks() -> torch.autograd.graph.saved_tensors_hooks:
    """The context that swaps saved unsharded parameters for tokens."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
