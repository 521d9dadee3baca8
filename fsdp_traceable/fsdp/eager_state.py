"""What one parameter group carries between eager calls; tracing never changes it.

Its fields are private: the group's life cycle (:class:`~.param_group.ParamGroup`)
moves them through the methods below, one per transition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .features.all_gather_extensions import PendingUnshard
from .features.post_forward_mesh import KeptPiece
from .kept_storage import KeptStorage

Versions = list[tuple[int, int]]


class EagerState:
    """A group's eager-only state.

    ``prefetched``: an all-gather issued ahead of the group's forward or backward, with
    the parameters' versions when it was issued (a changed parameter voids it).
    ``unsharded_for_backward``: the parameters re-gathered for backward, kept until
    backward ends (or until the next forward with ``reshard_after_backward=False``).
    ``forward_unsharded``: a trainable group that keeps its forward parameters for
    backward (no reshard after forward): what forward gathered, with the parameters'
    versions then. As in FSDP2 the group stays unsharded until a backward reshards it:
    later forwards use them (unless a parameter changed since), and a backward with
    ``reshard_after_backward=False`` keeps them for the next forward.
    ``accumulated_grads``: no-sync microbatches' gradients, by parameter index, in the
    reduce dtype.
    ``partial_reduce_output``: HSDP with ``set_requires_all_reduce(False)``: the
    reduce-scatter outputs summed so far, all-reduced by the next backward that
    all-reduces.
    ``kept_piece``: with ``reshard_after_forward=N``, this rank's piece of the last
    forward all-gather's output and the parameters' versions then (the next
    all-gather re-gathers from it unless a parameter changed since).
    ``kept_storage``: with ``set_keep_unsharded_storage(True)``, the unsharded storage
    all-gathers refill (:mod:`.kept_storage`).
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forgets everything (the group's parameters were re-created). In place: a
        reduction in flight keeps writing to this object."""
        self._prefetched: PendingUnshard | None = None
        self._prefetched_versions: Versions = []
        self._unsharded_for_backward: list[torch.Tensor] | None = None
        self._forward_unsharded: tuple[torch.Tensor, ...] | None = None
        self._forward_unsharded_versions: Versions = []
        self._accumulated_grads: dict[int, torch.Tensor] | None = None
        self._partial_reduce_output: torch.Tensor | None = None
        self._kept_piece: KeptPiece | None = None
        self._kept_piece_versions: Versions = []
        self.kept_storage = KeptStorage()

    # -- prefetch ---------------------------------------------------------------------

    @property
    def prefetched(self) -> PendingUnshard | None:
        """The all-gather issued ahead, if one is in flight."""
        return self._prefetched

    def keep_prefetched(self, result: PendingUnshard, versions: Versions) -> None:
        self._prefetched, self._prefetched_versions = result, versions

    def take_prefetched(self) -> tuple[PendingUnshard | None, Versions]:
        """The prefetched all-gather and its versions; clears it."""
        result, self._prefetched = self._prefetched, None
        return result, self._prefetched_versions

    # -- reshard_after_forward=N --------------------------------------------------------

    def keep_piece(self, piece: KeptPiece, versions: Versions) -> None:
        self._kept_piece, self._kept_piece_versions = piece, versions

    def take_piece(self) -> tuple[KeptPiece | None, Versions]:
        """The kept post-forward piece and its versions; clears it."""
        piece, self._kept_piece = self._kept_piece, None
        return piece, self._kept_piece_versions

    # -- unsharded parameters kept for (or after) backward --------------------------------

    @property
    def unsharded_for_backward(self) -> list[torch.Tensor] | None:
        """The parameters gathered for backward (or kept after it), if held."""
        return self._unsharded_for_backward

    def keep_for_backward(self, unsharded: list[torch.Tensor]) -> None:
        self._unsharded_for_backward = unsharded

    def drop_for_backward(self) -> None:
        self._unsharded_for_backward = None

    def keep_forward_unsharded(self, unsharded: tuple[torch.Tensor, ...], versions: Versions
                               ) -> None:
        """Forward's parameters (detached), held until a backward reshards them or keeps
        them for the next forward. Detached: a kept tensor that carried its autograd
        node would tie the group to that node's context (which holds the group), a
        cycle through autograd that Python's collector cannot free when no backward
        comes."""
        self._forward_unsharded = tuple(t.detach() for t in unsharded)
        self._forward_unsharded_versions = versions

    def forward_unsharded(self, versions: Versions) -> list[torch.Tensor] | None:
        """Fresh aliases of forward's held parameters if no parameter changed since
        (``versions``: the parameters' versions now); drops them if one did."""
        if not self._forward_unsharded_current(versions):
            return None
        return [t.detach() for t in self._forward_unsharded]

    @property
    def held_unsharded(self) -> tuple[torch.Tensor, ...] | list[torch.Tensor] | None:
        """The unsharded parameters held now, whatever changed since: those for (or kept
        after) a backward, else forward's; ``None`` if none (the group is sharded)."""
        if self._unsharded_for_backward is not None:
            return self._unsharded_for_backward
        return self._forward_unsharded

    def holds_forward_unsharded(self, versions: Callable[[], Versions]) -> bool:
        """Whether forward's parameters are held and no parameter changed since
        (``versions()``: the parameters' versions now, read only if some are held);
        drops them if one did, as :meth:`forward_unsharded` does."""
        return self._forward_unsharded is not None and self._forward_unsharded_current(versions())

    def _forward_unsharded_current(self, versions: Versions) -> bool:
        """Whether forward's parameters are held at ``versions``; drops them if held at others."""
        if self._forward_unsharded is None:
            return False
        if self._forward_unsharded_versions != versions:
            self._forward_unsharded = None
            return False
        return True

    def end_backward(self, reshard_after_backward: bool) -> None:
        """A backward's end: drops its parameters when resharding, otherwise holds
        forward's for the next forward. Mutates nothing while a backward is traced,
        where every field is None (Dynamo refuses side effects there)."""
        if reshard_after_backward and self._unsharded_for_backward is not None:
            self._unsharded_for_backward = None
        if self._forward_unsharded is not None:
            if not reshard_after_backward and self._unsharded_for_backward is None:
                self._unsharded_for_backward = list(self._forward_unsharded)
            self._forward_unsharded = None

    @property
    def holds_unsharded(self) -> bool:
        """Whether unsharded parameters are held for a backward or past one."""
        return self._unsharded_for_backward is not None or self._forward_unsharded is not None

    def drop_unsharded(self) -> None:
        """Drops every unsharded parameter held (the prefetched all-gather apart)."""
        self._unsharded_for_backward = None
        self._forward_unsharded = None
        self.take_piece()

    # -- gradient accumulation --------------------------------------------------------------

    def keep_partial_reduce_output(self, partial: torch.Tensor | None) -> None:
        self._partial_reduce_output = partial

    @property
    def has_partial_reduce_output(self) -> bool:
        """Whether HSDP backwards without the all-reduce left reduce-scatter output."""
        return self._partial_reduce_output is not None

    def take_partial_reduce_output(self) -> torch.Tensor | None:
        """The HSDP reduce-scatter outputs accumulated so far; clears them."""
        partial = self._partial_reduce_output
        if partial is not None:  # no mutation while a backward is traced
            self._partial_reduce_output = None
        return partial

    def keep_accumulated_grads(self, grads: dict[int, torch.Tensor] | None) -> None:
        self._accumulated_grads = grads

    @property
    def has_accumulated_grads(self) -> bool:
        """Whether no-sync microbatches left gradients to reduce."""
        return self._accumulated_grads is not None

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """The no-sync gradients accumulated so far; clears them."""
        accumulated = self._accumulated_grads
        if accumulated is not None:  # no mutation while a backward is traced
            self._accumulated_grads = None
        return accumulated
