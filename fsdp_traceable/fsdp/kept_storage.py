"""``set_keep_unsharded_storage(True)``: one unsharded storage per parameter that
outlives reshard, as FSDP2 keeps its unsharded parameters' storage.

Our all-gathers return fresh tensors (they are functional, so a compiled graph can see
them); with the storage kept, a group's eager all-gather output is copied into the
parameters' kept tensors, and the unsharded parameters the forward and backward use are
aliases of those, so their data pointers stay the same from one unshard to the next
(what CUDA graph capture needs). The copy leaves the version counter as it was, as
FSDP2's all-gather into its kept storage does: the storage is refilled only where
FSDP2 refills its own. Tensor subclasses (an all-gather extension's post hook output)
are passed through as they are.
"""

from __future__ import annotations

import torch

from ..collectives import comm


class KeptStorage:
    """One group's kept unsharded tensors (empty until the first all-gather with the
    storage kept)."""

    def __init__(self) -> None:
        self._tensors: list[torch.Tensor | None] = []

    def drop(self) -> None:
        """Frees the kept storage (the setting was turned off, or the parameters re-created)."""
        self._tensors = []

    def refill(self, unsharded: list[torch.Tensor]) -> list[torch.Tensor]:
        """Copies a finished all-gather's ``unsharded`` parameters into the kept storage
        and returns aliases of it (allocated on the first call, or on a change of shape
        or dtype).

        Raises:
            NotImplementedError: traced: a compiled graph allocates its own outputs.
        """
        if comm.use_traced_path():
            raise NotImplementedError(
                "set_keep_unsharded_storage(True) keeps eager all-gather storage across "
                "reshard; a compiled graph allocates its own. Call "
                "set_keep_unsharded_storage(False) before compiling"
            )
        if len(self._tensors) != len(unsharded):
            self._tensors = [None] * len(unsharded)
        result = []
        for i, tensor in enumerate(unsharded):
            kept = self._tensors[i]
            if type(tensor) is not torch.Tensor:
                result.append(tensor)
                continue
            if (kept is None or kept.shape != tensor.shape or kept.dtype != tensor.dtype
                    or kept.device != tensor.device):
                kept = self._tensors[i] = torch.empty_like(tensor)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(kept):
                kept.copy_(tensor)
            result.append(kept.detach())
        return result
