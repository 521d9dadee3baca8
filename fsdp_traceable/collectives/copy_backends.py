"""Who implements the copies around the collectives: one table, ``config.copy_kernels``.

Every backend implements :class:`~.copy_contract.CopyOps` (the four copies, with the
arguments and bits of the ``torch.ops.fsdp_traceable`` ops), so callers use whichever
:func:`backend_for` picks; this module's own four functions are that choice made per
call, and implement the contract too:

* ``"auto"`` (default): the fastest measured backend for the device and the copy
  (:data:`AUTO_TRACED_GPU` and :func:`auto_backend`): on a GPU with Triton, the
  Triton tile kernels, eager and under ``torch.compile``; elsewhere ``"inductor"``.
* ``"inductor"``: the ``torch.ops.fsdp_traceable`` ops (aten ops in eager,
  fused into one Inductor kernel per bucket under ``torch.compile``). It serves
  everything, and is what the other backends fall back to.
* ``"triton"``: the ``torch.ops.fsdp_traceable_triton`` ops (one Triton kernel per
  bucket, eager and under ``torch.compile``) for tensors on a GPU. On CPU it serves
  only eager calls with ``TRITON_INTERPRET=1`` set (the Triton interpreter: exact but
  slow, for testing); Triton kernels cannot run under ``torch.compile`` there.
* ``"foreach"``: :mod:`fsdp_traceable.collectives.foreach_copies` (FSDP2-style
  ``_foreach_copy_`` / ``split_with_sizes_copy`` / ``_chunk_cat(out=)`` into
  preallocated buffers), in eager only: ``out=`` buffers are what the traced path avoids.

The copy-out may return views of one shared buffer (``"triton"``, ``"foreach"``);
they never overlap.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .. import config
from ..tracing import compiled_autograd_tracing, forward_regions_in_use, is_tracing
from . import foreach_copies
from . import ops as aten_ops
from .copy_contract import CopyOps

_TRITON_DEVICES = ("cuda", "xpu")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CopyBackend:
    """One implementation of :class:`~.copy_contract.CopyOps`: each function field is
    the protocol's method of that name.

    ``serves(tensors)`` says whether it can run on these tensors right now (device,
    tracing).
    """

    name: str
    serves: Callable[[Sequence[torch.Tensor]], bool]
    all_gather_copy_in: Callable[..., torch.Tensor]
    all_gather_copy_in_into: Callable[..., None]
    all_gather_copy_out: Callable[..., list[torch.Tensor]]
    reduce_scatter_copy_in: Callable[..., torch.Tensor]


def _aten_copy_out(all_gather_output, world_size, global_sizes_flat, ndims, shard_dims, dtypes):
    return aten_ops.call("all_gather_copy_out", all_gather_output, world_size, list(global_sizes_flat),
                         list(ndims), list(shard_dims), list(dtypes))


ATEN = CopyBackend(
    name="inductor",
    serves=lambda tensors: True,
    all_gather_copy_in=lambda shards, padded_numels, dtype: aten_ops.call(
        "all_gather_copy_in", list(shards), list(padded_numels), dtype),
    all_gather_copy_in_into=aten_ops.all_gather_copy_in_into,
    all_gather_copy_out=_aten_copy_out,
    reduce_scatter_copy_in=lambda grads, world_size, shard_dims, reduce_dtype, predivide_factor: (
        aten_ops.call("reduce_scatter_copy_in", list(grads), world_size, list(shard_dims),
                      reduce_dtype, predivide_factor)),
)

FOREACH = CopyBackend(
    name="foreach",
    serves=lambda tensors: not is_tracing(tensors),
    all_gather_copy_in=foreach_copies.all_gather_copy_in,
    all_gather_copy_in_into=foreach_copies.all_gather_copy_in_into,
    all_gather_copy_out=foreach_copies.all_gather_copy_out,
    reduce_scatter_copy_in=foreach_copies.reduce_scatter_copy_in,
)


def _triton_serves(tensors: Sequence[torch.Tensor]) -> bool:
    device = tensors[0].device
    if device.type == "cpu":
        return not is_tracing(tensors) and os.environ.get("TRITON_INTERPRET") == "1"
    return device.type in _TRITON_DEVICES


def _triton_module():
    if not triton_importable():
        raise RuntimeError(
            "fsdp_traceable.config.copy_kernels='triton' needs the triton package: "
            "install triton, or set copy_kernels to 'inductor' or 'foreach'"
        )
    import fsdp_traceable.triton_kernels as triton_kernels

    return triton_kernels


def _triton_copy_in(shards, padded_numels, dtype):
    return _triton_module().all_gather_copy_in(list(shards), list(padded_numels), dtype)


def _triton_copy_in_into(shards, padded_numels, out):
    _triton_module().all_gather_copy_in_into(list(shards), list(padded_numels), out)


def _triton_copy_out(all_gather_output, world_size, global_sizes_flat, ndims, shard_dims,
                     dtypes):
    kernels = _triton_module()
    sizes, dims = list(global_sizes_flat), list(ndims)
    flat = kernels.all_gather_copy_out(
        all_gather_output, world_size, sizes, dims, list(shard_dims), [d.itemsize for d in dtypes])
    return kernels.unsharded_views(flat, sizes, dims, list(dtypes))


def _triton_reduce_scatter_copy_in(grads, world_size, shard_dims, reduce_dtype, predivide_factor):
    return _triton_module().reduce_scatter_copy_in(
        list(grads), world_size, list(shard_dims), reduce_dtype, predivide_factor)


TRITON = CopyBackend(
    name="triton",
    serves=_triton_serves,
    all_gather_copy_in=_triton_copy_in,
    all_gather_copy_in_into=_triton_copy_in_into,
    all_gather_copy_out=_triton_copy_out,
    reduce_scatter_copy_in=_triton_reduce_scatter_copy_in,
)

COPY_BACKENDS: dict[str, CopyBackend] = {b.name: b for b in (ATEN, TRITON, FOREACH)}
COPY_KERNELS = ("auto", *COPY_BACKENDS)
# Each backend, and foreach_copies itself, implements the contract (for type checkers;
# tests/collectives/test_copy_contract.py checks the signatures).
_IMPLEMENTATIONS: tuple[CopyOps, ...] = (ATEN, TRITON, FOREACH, foreach_copies)

# "auto" on a GPU with Triton: the tile kernels for every copy, eager and under
# torch.compile (where each copy is one opaque op launching the same kernel). The last
# measured alternatives (one H200, world 8, fp32 shards -> bf16, % of HBM peak, before
# the tile kernels): Inductor's fusion 8-59% and per-bucket generated Triton kernels
# 19-88%, the generated ones slow to compile at 100+ parameters; Inductor's fusion of
# the reduce-scatter copy-in also rounds the pre-divide differently from eager.
AUTO_TRACED_GPU = {
    "all_gather_copy_in": "triton",
    "all_gather_copy_out": "triton",
    "reduce_scatter_copy_in": "triton",
}


@functools.cache
def triton_importable() -> bool:
    """Whether the ``triton`` package (and so :mod:`fsdp_traceable.triton_kernels`) can be imported;
    looked up once, not on every copy."""
    return importlib.util.find_spec("triton") is not None


def auto_backend(tensors: Sequence[torch.Tensor], copy: str, num_params: int) -> CopyBackend:
    """The backend ``"auto"`` picks for ``copy`` (an op name) of ``num_params``
    parameters on ``tensors``: Triton on a GPU (eager: always; traced: per
    :data:`AUTO_TRACED_GPU`), aten elsewhere or without Triton."""
    del num_params  # one tile kernel serves every bucket size
    if tensors[0].device.type not in _TRITON_DEVICES or not triton_importable():
        return ATEN
    if not is_tracing(tensors):
        return TRITON
    return COPY_BACKENDS[AUTO_TRACED_GPU[copy]]


def copy_kernels() -> str:
    """The validated ``config.copy_kernels`` value."""
    mode = config.copy_kernels
    if mode not in COPY_KERNELS:
        raise ValueError(
            f"fsdp_traceable.config.copy_kernels={mode!r}; use one of "
            f"{', '.join(map(repr, COPY_KERNELS))}"
        )
    return mode


def backend_for(tensors: Sequence[torch.Tensor], copy: str, num_params: int) -> CopyBackend:
    """The backend for ``copy`` (an op name) of ``num_params`` parameters on
    ``tensors``: the one ``config.copy_kernels`` names (or ``"auto"`` picks) if it
    serves ``tensors`` now, else aten."""
    # A copy's tensors are on one device and all traced or none: the first one tells.
    first = tensors[:1]
    if torch.compiler.is_compiling():
        if config.copy_kernels in ("auto", "inductor") and (
                config.copy_kernels == "inductor" or first[0].device.type not in _TRITON_DEVICES):
            return ATEN  # what the lines below pick, in fewer bytecodes for Dynamo to trace
        if copy == "all_gather_copy_out" and (
                forward_regions_in_use() or compiled_autograd_tracing()):
            # The Triton copy-out returns views of one buffer; a region's inputs and
            # outputs may not share storage, and the aten copy-out gives each parameter
            # its own buffer there (see [Note: copy regions], aten_ops.fresh_outputs_needed).
            # Same bits either way.
            return ATEN
    mode = copy_kernels()
    if mode == "auto":
        backend = auto_backend(first, copy, num_params)
    else:
        backend = COPY_BACKENDS[mode]
    chosen = backend if backend.serves(first) else ATEN
    # Not while Dynamo traces (a logger call there is a graph break).
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        device = first[0].device.type if first else "no device"
        _log_choice(copy, mode, backend.name, chosen.name, device, is_tracing(first))
    return chosen


@functools.cache
def _log_choice(copy: str, mode: str, picked: str, chosen: str, device: str,
                traced: bool) -> None:
    """Debug log, once per distinct choice: which backend runs ``copy``."""
    fallback = f" ({picked} does not serve these tensors)" if picked != chosen else ""
    log.debug("copy backend for %s on %s%s: %s%s (copy_kernels=%r)", copy, device,
              " (traced)" if traced else "", chosen, fallback, mode)


def all_gather_copy_in(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], dtype: torch.dtype
) -> torch.Tensor:
    """:meth:`CopyOps.all_gather_copy_in`, by the backend ``config.copy_kernels`` picks."""
    backend = backend_for(shards, "all_gather_copy_in", len(shards))
    return backend.all_gather_copy_in(shards, padded_numels, dtype)


def all_gather_copy_in_into(
    shards: Sequence[torch.Tensor], padded_numels: Sequence[int], out: torch.Tensor
) -> None:
    """:meth:`CopyOps.all_gather_copy_in_into`, by the backend ``config.copy_kernels`` picks."""
    backend = backend_for(shards, "all_gather_copy_in", len(shards))
    backend.all_gather_copy_in_into(shards, padded_numels, out)


def all_gather_copy_out(
    all_gather_output: torch.Tensor,
    world_size: int,
    global_sizes_flat: Sequence[int],
    ndims: Sequence[int],
    shard_dims: Sequence[int],
    dtypes: Sequence[torch.dtype],
) -> list[torch.Tensor]:
    """:meth:`CopyOps.all_gather_copy_out`, by the backend ``config.copy_kernels`` picks."""
    backend = backend_for([all_gather_output], "all_gather_copy_out", len(ndims))
    return backend.all_gather_copy_out(
        all_gather_output, world_size, global_sizes_flat, ndims, shard_dims, dtypes)


def reduce_scatter_copy_in(
    grads: Sequence[torch.Tensor],
    world_size: int,
    shard_dims: Sequence[int],
    reduce_dtype: torch.dtype,
    predivide_factor: float | None,
) -> torch.Tensor:
    """:meth:`CopyOps.reduce_scatter_copy_in`, by the backend ``config.copy_kernels`` picks."""
    backend = backend_for(grads, "reduce_scatter_copy_in", len(grads))
    return backend.reduce_scatter_copy_in(
        grads, world_size, shard_dims, reduce_dtype, predivide_factor)
