"""Eager reshard-after-forward: autograd saves a token, not the unsharded parameter.

While a group's forward runs, a ``saved_tensors_hooks`` pack hook replaces every
saved tensor that lives in one of the group's unsharded parameters (the parameter or
a view of it) with ``(group, index, view geometry)``. The unpack hook asks the group
for its parameters again, which all-gathers them once for the whole backward of the
group, and rebuilds the view. The unsharded parameters are therefore freed as soon
as forward no longer references them.

An all-gather extension's unsharded parameter is a wrapper subclass (e.g. a float8
weight: 1-byte data plus a scale). A saved tensor of such a subclass (the parameter,
or one derived from it, such as its transpose) has each inner tensor that lives in
one of the parameter's inner tensors swapped for a token the same way, and is rebuilt
with ``__tensor_unflatten__`` around the re-gathered inner tensors.

Each model has its own :class:`SavedUnsharded` (on its
:class:`~fsdp_traceable.fsdp.root_state.RootState`): its hooks swap only that model's
parameters, and nothing of a model outlives it here.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch._subclasses.fake_tensor import FakeTensor


class RegatheringGroup(Protocol):
    """What a token asks of its parameter group (``ParamGroup``) when it is unpacked."""

    def pre_backward(self) -> list[torch.Tensor]:
        """The group's unsharded parameters, gathered once for its backward."""
        ...

# FakeTensor: a step run on fake tensors (the planner's) reshards as a real one does.
_PLAIN = (torch.Tensor, torch.nn.Parameter, FakeTensor)


class Regathered:
    """The parameters one group's tokens unpack to within one traced backward.

    [Note: a traced unpack asks its group once]
    Where Dynamo traces a backward (compiled autograd's, per-block compile: every
    block's saved tokens), each token's unpack asking its group again is a few more
    inlined frames per saved parameter, per block. The first unpack of a group's
    tokens asks it (``pre_backward``: the traced re-gather) and keeps the answer here,
    which the group's other tokens read; a callback at the backward's end clears it,
    so the trace leaves nothing here and the next backward asks again. Eager, every
    unpack asks the group, which holds its parameters only as long as it decides
    (they are freed after its own backward), so this never holds them.
    """

    def __init__(self, group: RegatheringGroup) -> None:
        self.group = group
        self.unsharded: list[torch.Tensor] | None = None
        # Whether the forward saved a token of the group's (its backward then re-gathers
        # at the first unpack).
        self.saved = False

    def clear(self) -> None:
        self.unsharded = None


class _SavedUnshardedView(NamedTuple):
    regathered: Regathered
    index: int
    attr: str | None  # the inner tensor of a wrapper-subclass parameter, or None
    size: torch.Size
    stride: tuple[int, ...]
    offset: int  # in elements, from the parameter's first element


class _SavedSubclass(NamedTuple):
    cls: type
    flatten_context: Any
    size: torch.Size
    stride: tuple[int, ...]
    inner: dict[str, Any]  # attribute -> token, or the inner tensor itself


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage: its ``StorageImpl``'s address, not its data
    pointer, which is 0 for every fake or meta tensor (the planner runs steps on those)."""
    return tensor.untyped_storage()._cdata


def _storage_tensors(tensor: torch.Tensor) -> list[tuple[str | None, torch.Tensor]]:
    """``tensor`` itself if it has storage, else its inner tensors that have."""
    if type(tensor) in _PLAIN:
        return [(None, tensor)] if tensor.numel() > 0 else []
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return []
    attrs, _ = flatten()
    inner = [(attr, getattr(tensor, attr)) for attr in attrs]
    return [(attr, t) for attr, t in inner if type(t) in _PLAIN and t.numel() > 0]


class SavedUnsharded:
    """One model's unsharded parameters alive in an eager forward that reshards after
    forward, and the saved-tensor hooks that swap them for tokens."""

    def __init__(self) -> None:
        # storage key (_storage_key) -> (the group's Regathered, parameter index, dtype,
        # inner attribute or None, storage offset) of every unsharded parameter (or inner
        # tensor of one) registered.
        self._live: dict[int, tuple[Regathered, int, torch.dtype, str | None, int]] = {}

    def __len__(self) -> int:
        return len(self._live)

    def register(self, group: RegatheringGroup, unsharded: list[torch.Tensor]) -> Regathered:
        """Saves of ``unsharded`` (``group``'s parameters, by index) become tokens.

        Returns:
            What the tokens unpack through; its ``saved`` says whether any was saved.
        """
        regathered = Regathered(group)
        for index, tensor in enumerate(unsharded):
            for attr, storage_tensor in _storage_tensors(tensor):
                self._live[_storage_key(storage_tensor)] = (
                    regathered, index, storage_tensor.dtype, attr, storage_tensor.storage_offset())
        return regathered

    def unregister(self, unsharded: list[torch.Tensor]) -> None:
        """Ends what :meth:`register` started (the forward that gathered them ended)."""
        for tensor in unsharded:
            for _, storage_tensor in _storage_tensors(tensor):
                self._live.pop(_storage_key(storage_tensor), None)

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context that swaps saved unsharded parameters for tokens."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _token(self, tensor: torch.Tensor) -> _SavedUnshardedView | None:
        """The token for a plain strided ``tensor`` living in an unsharded parameter."""
        if tensor.layout != torch.strided:
            return None
        entry = self._live.get(_storage_key(tensor))
        if entry is None or entry[2] != tensor.dtype or tensor.numel() == 0:
            return None
        regathered, index, _, attr, param_offset = entry
        regathered.saved = True
        return _SavedUnshardedView(
            regathered, index, attr, tensor.size(), tensor.stride(),
            tensor.storage_offset() - param_offset
        )

    def _pack(self, tensor: torch.Tensor) -> object:
        # Runs for every tensor autograd saves: the common miss costs one storage lookup.
        if type(tensor) in _PLAIN:
            token = self._token(tensor)
            return tensor if token is None else token
        flatten = getattr(tensor, "__tensor_flatten__", None)
        if flatten is None or not self._live:
            return tensor
        attrs, context = flatten()
        inner = {attr: getattr(tensor, attr) for attr in attrs}
        tokens = {attr: self._token(t) if type(t) in _PLAIN else None
                  for attr, t in inner.items()}
        if all(token is None for token in tokens.values()):
            return tensor
        return _SavedSubclass(type(tensor), context, tensor.size(), tensor.stride(),
                              {attr: tokens[attr] or inner[attr] for attr in attrs})


def _unpack(saved: object) -> torch.Tensor:
    # One function for every case: Dynamo inlines it once per saved tensor where it
    # traces a backward, and a call per token would be a frame more each.
    if isinstance(saved, _SavedSubclass):
        inner = {attr: _unpack(value) for attr, value in saved.inner.items()}
        return saved.cls.__tensor_unflatten__(inner, saved.flatten_context, saved.size,
                                              saved.stride)
    if not isinstance(saved, _SavedUnshardedView):
        return saved
    regathered = saved.regathered
    if not torch.compiler.is_compiling():
        unsharded = regathered.group.pre_backward()
    elif regathered.unsharded is None:
        # See [Note: a traced unpack asks its group once].
        unsharded = regathered.unsharded = regathered.group.pre_backward()
        torch.autograd.Variable._execution_engine.queue_callback(regathered.clear)
    else:
        unsharded = regathered.unsharded
    base = unsharded[saved.index]
    if saved.attr is not None:
        base = getattr(base, saved.attr)
    if saved.offset == 0 and base.size() == saved.size and base.stride() == saved.stride:
        # The whole parameter (most saves: a weight, a norm's scale): no view op, so a
        # traced re-gather adds no op per saved parameter to compiled autograd's graph.
        return base
    # The re-gathered parameter may start elsewhere in its storage (a traced re-gather's
    # copy-out slices one buffer), so the view is rebuilt from its first element.
    # as_strided keeps the slice's storage offset, which Dynamo need not read.
    return base.view(-1)[saved.offset:].as_strided(saved.size, saved.stride)
