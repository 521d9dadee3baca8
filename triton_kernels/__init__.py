"""Fused Triton kernels for the copies around FSDP's collectives.

Importing this package registers the ``torch.ops.fsdp_traceable_triton`` ops (see
:mod:`.ops`) when ``triton`` and ``torch`` are installed. Without torch
only the torch-free modules import: ``fields``, ``kernels`` (through ``loader``),
and ``launch_args`` (the GPU target check, ``tests/triton_kernels/gpu_targets.py``,
builds on them).
Use :func:`is_available` to test for triton without importing anything. The usual
entry point is
:mod:`fsdp_traceable.collectives.copy_backends`, which picks these kernels when
``fsdp_traceable.config.copy_kernels == "triton"``.
"""

from __future__ import annotations

import importlib.util


def is_available() -> bool:
    """Whether ``triton`` is installed (the kernels may still need a GPU or
    ``TRITON_INTERPRET=1`` on CPU to run)."""
    return importlib.util.find_spec("triton") is not None


if is_available() and importlib.util.find_spec("torch") is not None:
    from .ops import (  # noqa: F401  (registers torch.ops.fsdp_traceable_triton)
        SUPPORTED_DTYPES,
        all_gather_copy_in,
        all_gather_copy_in_into,
        all_gather_copy_out,
        reduce_scatter_copy_in,
        unsharded_views,
    )

__all__ = [
    "SUPPORTED_DTYPES",
    "all_gather_copy_in",
    "all_gather_copy_in_into",
    "all_gather_copy_out",
    "is_available",
    "reduce_scatter_copy_in",
    "unsharded_views",
]
