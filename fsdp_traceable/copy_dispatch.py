"""Picks who implements the copies around the collectives: ``config.copy_kernels``.

Each function here takes the same arguments as its ``torch.ops.fsdp_traceable`` op and
returns the same bits, so callers can use them as drop-in replacements:

* ``"inductor"`` (default): the ``torch.ops.fsdp_traceable`` op (aten ops in eager,
  fused into one Inductor kernel per bucket under ``torch.compile``).
* ``"triton"``: the ``torch.ops.fsdp_traceable_triton`` op (one Triton kernel per
  bucket, eager and under ``torch.compile``) for tensors on a GPU. On CPU it runs
  only eagerly and only with ``TRITON_INTERPRET=1`` set (the Triton interpreter: exact
  but slow, for testing); under ``torch.compile`` on CPU, or without that variable,
  CPU tensors take the ``"inductor"`` path, since Triton cannot run there.
* ``"foreach"``: in eager, :mod:`fsdp_traceable.foreach_copies` (FSDP2-style
  ``_foreach_copy_`` / ``split_with_sizes_copy`` / ``_chunk_cat(out=)`` into
  preallocated buffers); under ``torch.compile``, the ``"inductor"`` path (``out=``
  buffers are what the traced path avoids).

The copy-out returns tensors that may be views of one shared buffer (``"triton"``,
``"foreach"``); they never overlap.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from . import config, foreach_copies
from . import ops as aten_ops

COPY_KERNELS = ("inductor", "triton", "foreach")
_TRITON_DEVICES = ("cuda", "xpu")


def copy_kernels() -> str:
    """The validated ``config.copy_kernels`` value."""
    mode = config.copy_kernels
    if mode not in COPY_KERNELS:
        raise ValueError(
            f"fsdp_traceable.config.copy_kernels={mode!r}; use one of {', '.join(map(repr, COPY_KERNELS))}"
        )
    return mode


def _tracing(tensors: Sequence[torch.Tensor]) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def _triton_ops(tensors: Sequence[torch.Tensor]):
    """``torch.ops.fsdp_traceable_triton`` if the Triton kernels serve these tensors
    now, else ``None``."""
    device = tensors[0].device
    if device.type == "cpu":
        if _tracing(tensors) or os.environ.get("TRITON_INTERPRET") != "1":
            return None
    elif device.type not in _TRITON_DEVICES:
        return None
    try:
        import triton_kernels  # noqa: F401  (registers the ops)
    except ImportError as error:
        raise RuntimeError(
            "fsdp_traceable.config.copy_kernels='triton' needs the triton package: "
            "install triton, or set copy_kernels to 'inductor' or 'foreach'"
        ) from error
    return torch.ops.fsdp_traceable_triton


def _use_foreach(tensors: Sequence[torch.Tensor]) -> bool:
    return not _tracing(tensors)


def all_gather_copy_in(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """``torch.ops.fsdp_traceable.all_gather_copy_in`` by ``config.copy_kernels``.

    Args:
        shards: this rank's shards, on one device.
        padded_numels: each shard's padded numel in the flat input.
        dtype: the all-gather dtype (``torch.uint8`` for a mixed-dtype bucket).

    Returns:
        The flat all-gather input.
    """
    mode = copy_kernels()
    if mode == "triton" and (ops := _triton_ops(shards)) is not None:
        return ops.all_gather_copy_in(list(shards), list(padded_numels), dtype)
    if mode == "foreach" and _use_foreach(shards):
        return foreach_copies.all_gather_copy_in(shards, padded_numels, dtype)
    return torch.ops.fsdp_traceable.all_gather_copy_in(list(shards), list(padded_numels), dtype)


def all_gather_copy_in_into(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor
) -> None:
    """Eager-only ``fsdp_traceable.ops.all_gather_copy_in_into`` by
    ``config.copy_kernels``: the copy-in written into ``out`` (e.g. this rank's slice
    of the all-gather output).

    Args:
        shards: this rank's shards, on one device.
        padded_numels: each shard's padded numel in the flat input.
        out: a contiguous 1-D tensor of the all-gather dtype and the input's numel.
    """
    mode = copy_kernels()
    if mode == "triton" and _triton_ops(shards) is not None:
        from triton_kernels import all_gather_copy_in_into as triton_into

        triton_into(list(shards), list(padded_numels), out)
    elif mode == "foreach":
        foreach_copies.all_gather_copy_in_into(shards, padded_numels, out)
    else:
        aten_ops.all_gather_copy_in_into(shards, padded_numels, out)


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    global_sizes_flat: Sequence[int],
    ndims: Sequence[int],
    shard_dims: Sequence[int],
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """``torch.ops.fsdp_traceable.all_gather_copy_out`` by ``config.copy_kernels``.

    Args:
        all_gather_output: the ``[world_size * numel]`` all-gather output.
        world_size: number of ranks.
        global_sizes_flat: the unsharded sizes, flattened.
        ndims: each parameter's number of dims.
        shard_dims: each parameter's shard dim.
        dtypes: each parameter's dtype.

    Returns:
        One unsharded, contiguous tensor per parameter.
    """
    mode = copy_kernels()
    args = (list(global_sizes_flat), list(ndims), list(shard_dims))
    if mode == "triton" and (ops := _triton_ops([all_gather_output])) is not None:
        from triton_kernels import unsharded_views

        flat = ops.all_gather_copy_out(
            all_gather_output, world_size, *args, [d.itemsize for d in dtypes])
        return unsharded_views(flat, args[0], args[1], list(dtypes))
    if mode == "foreach" and _use_foreach([all_gather_output]):
        return foreach_copies.all_gather_copy_out(
            all_gather_output, world_size, *args, list(dtypes))
    return torch.ops.fsdp_traceable.all_gather_copy_out(
        all_gather_output, world_size, *args, list(dtypes))


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    world_size: int,
    shard_dims: Sequence[int],
    reduce_dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    """``torch.ops.fsdp_traceable.reduce_scatter_copy_in`` by ``config.copy_kernels``.

    Args:
        grads: unsharded gradients, on one device.
        world_size: number of ranks.
        shard_dims: each gradient's shard dim.
        reduce_dtype: the reduce-scatter dtype.
        predivide_factor: divide by this after the cast (``None``: no divide).

    Returns:
        The flat reduce-scatter input.
    """
    mode = copy_kernels()
    if mode == "triton" and (ops := _triton_ops(grads)) is not None:
        return ops.reduce_scatter_copy_in(
            list(grads), world_size, list(shard_dims), reduce_dtype, predivide_factor)
    if mode == "foreach" and _use_foreach(grads):
        return foreach_copies.reduce_scatter_copy_in(
            grads, world_size, shard_dims, reduce_dtype, predivide_factor)
    return torch.ops.fsdp_traceable.reduce_scatter_copy_in(
        list(grads), world_size, list(shard_dims), reduce_dtype, predivide_factor)
