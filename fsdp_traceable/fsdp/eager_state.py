"""What one parameter group carries between eager calls; tracing never touches it."""

from __future__ import annotations

import torch

from .all_gather_extensions import PendingUnshard


class EagerState:
    """A group's eager-only state.

    ``prefetched``: an all-gather issued ahead of the group's forward or backward, with
    the parameters' versions when it was issued (a changed parameter voids it).
    ``unsharded_for_backward``: the parameters re-gathered for backward, kept until
    backward ends (or until the next forward with ``reshard_after_backward=False``).
    ``forward_unsharded``: a group that keeps its forward parameters for backward
    (no reshard after forward) and will not reshard after backward: what forward
    gathered, to keep after backward as FSDP2 does.
    ``accumulated_unsharded_grads``: no-sync microbatches' gradients, by parameter
    index, in the reduce dtype.
    """

    def __init__(self) -> None:
        self.prefetched: PendingUnshard | None = None
        self.prefetched_versions: list[tuple[int, int]] = []
        self.unsharded_for_backward: list[torch.Tensor] | None = None
        self.forward_unsharded: tuple[torch.Tensor, ...] | None = None
        self.accumulated_unsharded_grads: dict[int, torch.Tensor] | None = None

    def prefetch(self, result: PendingUnshard, versions: list[tuple[int, int]]) -> None:
        self.prefetched, self.prefetched_versions = result, versions

    def take_prefetched(self) -> tuple[PendingUnshard | None, list[tuple[int, int]]]:
        """The prefetched all-gather and its versions; clears it."""
        result, self.prefetched = self.prefetched, None
        return result, self.prefetched_versions

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """The no-sync gradients accumulated so far; clears them."""
        accumulated = self.accumulated_unsharded_grads
        if accumulated is not None:  # no mutation while a backward is traced
            self.accumulated_unsharded_grads = None
        return accumulated
