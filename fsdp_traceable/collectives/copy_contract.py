"""The copy-op contract: the four copies around the collectives, written once.

Every copy backend (:mod:`.copy_backends`: the ``torch.ops.fsdp_traceable`` ops of
:mod:`.ops`, the foreach copies of :mod:`.foreach_copies`, the Triton kernels of the
top-level ``triton_kernels`` package) implements :class:`CopyOps`: same arguments,
same bits. A backend's own docstrings say only how it does it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class CopyOps(Protocol):
    """The copies around FSDP's collectives; every backend gives the same bits.

    Outputs are fresh tensors, or (copy-out) views of one fresh buffer that never
    overlap; no output aliases an input.
    """

    def all_gather_copy_in(
        self, shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
    ) -> torch.Tensor:
        """Packs this rank's shards into one flat all-gather input.

        Each shard is flattened, cast to ``dtype`` (or, when ``dtype`` is ``uint8`` for
        a bucket of mixed dtypes, reinterpreted as bytes) and zero-padded to
        ``padded_numels[i]`` elements of its own dtype.

        Args:
            shards: this rank's shards, on one device.
            padded_numels: each shard's padded numel in the flat input.
            dtype: the all-gather dtype; ``torch.uint8`` packs a mixed-dtype bucket as bytes.

        Returns:
            The flat all-gather input (padding zeroed), ``sum(padded_numels)`` elements
            (bytes for ``uint8``).
        """
        ...

    def all_gather_copy_in_into(
        self, shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor
    ) -> None:
        """Eager only: :meth:`all_gather_copy_in` written into ``out`` (this rank's slice
        of the all-gather output, as FSDP2 does), so no separate input buffer is
        allocated; the same bits.

        Args:
            shards: this rank's shards, on one device.
            padded_numels: each shard's padded numel in the flat input.
            out: a contiguous 1-D tensor of the all-gather dtype and the input's numel.
        """
        ...

    def all_gather_copy_out(
        self,
        all_gather_output: torch.Tensor,
        world_size: int,
        global_sizes_flat: Sequence[int],
        ndims: Sequence[int],
        shard_dims: Sequence[int],
        dtypes: Sequence[torch.dtype],
    ) -> list[torch.Tensor]:
        """Unpacks the all-gather output into the unsharded parameters.

        ``Shard(0)`` parameters are the rank chunks stacked with the dim-0 padding
        stripped; ``Shard(d > 0)`` parameters are the rank chunks concatenated along
        ``d``.

        Args:
            all_gather_output: the ``[world_size * numel]`` all-gather output; ``uint8``
                for a mixed-dtype bucket.
            world_size: number of ranks.
            global_sizes_flat: the unsharded sizes, flattened (see ``flatten_sizes``).
            ndims: each parameter's number of dims.
            shard_dims: each parameter's shard dim.
            dtypes: each parameter's dtype (read for a ``uint8`` output).

        Returns:
            One unsharded, contiguous tensor per parameter.
        """
        ...

    def reduce_scatter_copy_in(
        self,
        grads: Sequence[torch.Tensor],
        world_size: int,
        shard_dims: Sequence[int],
        reduce_dtype: torch.dtype,
        predivide_factor: float | None,
    ) -> torch.Tensor:
        """Lays unsharded gradients out as the flat reduce-scatter input.

        Rank ``r``'s contiguous slice holds, per parameter, rank ``r``'s (dim-0 padded)
        chunk, as ``torch._chunk_cat(dim0_grads, 0, world_size)``: ``Shard(d > 0)``
        gradients have their ``d``-chunks moved to dim 0 first. Cast to
        ``reduce_dtype``, then pre-divided.

        Args:
            grads: unsharded gradients, on one device.
            world_size: number of ranks.
            shard_dims: each gradient's shard dim.
            reduce_dtype: the reduce-scatter dtype.
            predivide_factor: divide by this after the cast (``None``: no divide).

        Returns:
            The flat reduce-scatter input, of ``reduce_dtype``.
        """
        ...


COPY_OPS = ("all_gather_copy_in", "all_gather_copy_in_into", "all_gather_copy_out",
            "reduce_scatter_copy_in")
"""The names of :class:`CopyOps`' methods, in order."""
