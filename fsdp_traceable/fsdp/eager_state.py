"""What one parameter group carries between eager calls; tracing never touches it."""

from __future__ import annotations

import torch

from .all_gather_extensions import PendingUnshard
from .post_forward import KeptPiece


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
    ``accumulated_unsharded_grads``: no-sync microbatches' gradients, by parameter
    index, in the reduce dtype.
    ``partial_reduce_output``: HSDP with ``set_requires_all_reduce(False)``: the
    reduce-scatter outputs summed so far, all-reduced by the next backward that
    all-reduces.
    ``post_forward``: with ``reshard_after_forward=N``, this rank's piece of the last
    forward all-gather's output and the parameters' versions then (the next
    all-gather re-gathers from it unless a parameter changed since).
    """

    def __init__(self) -> None:
        self.prefetched: PendingUnshard | None = None
        self.prefetched_versions: list[tuple[int, int]] = []
        self.unsharded_for_backward: list[torch.Tensor] | None = None
        self.forward_unsharded: tuple[torch.Tensor, ...] | None = None
        self.forward_unsharded_versions: list[tuple[int, int]] = []
        self.accumulated_unsharded_grads: dict[int, torch.Tensor] | None = None
        self.partial_reduce_output: torch.Tensor | None = None
        self.post_forward: KeptPiece | None = None
        self.post_forward_versions: list[tuple[int, int]] = []

    def prefetch(self, result: PendingUnshard, versions: list[tuple[int, int]]) -> None:
        self.prefetched, self.prefetched_versions = result, versions

    def take_prefetched(self) -> tuple[PendingUnshard | None, list[tuple[int, int]]]:
        """The prefetched all-gather and its versions; clears it."""
        result, self.prefetched = self.prefetched, None
        return result, self.prefetched_versions

    def keep_post_forward(self, piece: KeptPiece, versions: list[tuple[int, int]]) -> None:
        self.post_forward, self.post_forward_versions = piece, versions

    def take_post_forward(self) -> tuple[KeptPiece | None, list[tuple[int, int]]]:
        """The kept post-forward piece and its versions; clears it."""
        piece, self.post_forward = self.post_forward, None
        return piece, self.post_forward_versions

    def take_partial_reduce_output(self) -> torch.Tensor | None:
        """The HSDP reduce-scatter outputs accumulated so far; clears them."""
        partial = self.partial_reduce_output
        if partial is not None:  # no mutation while a backward is traced
            self.partial_reduce_output = None
        return partial

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """The no-sync gradients accumulated so far; clears them."""
        accumulated = self.accumulated_unsharded_grads
        if accumulated is not None:  # no mutation while a backward is traced
            self.accumulated_unsharded_grads = None
        return accumulated
