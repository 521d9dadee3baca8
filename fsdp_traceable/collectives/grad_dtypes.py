"""The dtypes unsharded gradients take, as the installed torch's FSDP2 gives them.

[Note: wider gradient dtypes]
From torch 2.15, FSDP2 gives every unsharded parameter a ``Tensor.grad_dtype`` (its
``FSDPParam.unsharded_grad_dtype``: the policy's ``reduce_dtype``, else the parameter's
own dtype) and no longer clamps ``reduce_dtype`` to ``None`` where it equals
``param_dtype``. Where that dtype is wider than the compute dtype (bf16/fp16 compute
without ``reduce_dtype``, or with an fp32 one), it sets ``grad_dtype = None`` for the
backward (``FSDPParamGroup._set_unsharded_grad_dtypes``), so autograd hands over each
gradient in the dtype its op computed it in: a norm weight used as
``x.float() * weight`` gets its fp32 gradient, no longer rounded to bf16 first. The
reduce-scatter then runs in that wider dtype (``_get_reduce_dtype`` promotes over the
parameters' ``unsharded_grad_dtype``: fp32 for bf16/fp16 compute without
``reduce_dtype``, where torch 2.13 reduced in bf16/fp16), its copy-in casting a bucket
of mixed bf16/fp32 gradients (``fsdp::chunk_cat_mixed_dtype``); a no-sync microbatch
casts its gradient to ``grad_dtype`` before adding it to the earlier ones, where
torch 2.13 added it to the ``reduce_dtype`` accumulator first and rounded the sum.

A tensor-parallel parameter keeps its ``grad_dtype`` through backward (FSDP2's
``may_reduce_grad_outside_dp``), so the reduction of its gradient over the TP mesh (a
replicated norm weight's ``Partial``) runs in that dtype too (:func:`tp_grad_dtype`).

``fully_shard`` follows whichever its torch's FSDP2 does, detected from FSDP2 itself:
:func:`keeps_wider_grads` reads both FSDP2's ``unsharded_grad_dtype`` and autograd's
``FunctionCtx.set_output_grad_dtype``, through which the unsharded parameters (outputs
of ``UnshardParams``, and the TP DTensors around them) pass such gradients uncast
(:func:`output_grad_dtypes`).

Compiled, autograd still rounds such a gradient to the compute dtype (measured on
torch 2.15.0): the package cannot prevent it without changing torch. The rounding is the
engine's cast of a gradient to the grad dtype of the output it flows into, done before
``UnshardParams``' backward runs, so the traced backward (the reduce-scatter's
copy-in, which casts to the reduce dtype) receives the rounded bf16 value and cannot
recover the lost bits. Under compile, that grad dtype cannot be declared: Dynamo traces
the Function into torch's ``autograd_function_apply`` higher-order op; the context it
traces the forward with cannot take ``set_output_grad_dtype`` (calling it fails with
"'FunctionCtx' object has no attribute 'output_grad_dtypes'"; assigning that attribute
is traced and dropped), and whose runtime ``ApplyTemplate``, the ``autograd.Function``
AOTAutograd traces the joint graph through, declares only dirty and non-differentiable
outputs. So AOTAutograd's backward graph holds ``_to_copy(grad, bfloat16)`` at that
edge, then the copy-in's cast back to float32. Keeping the gradient wide compiled takes
torch carrying the declared dtypes from Dynamo's ctx into the op's kwargs and
``ApplyTemplate.setup_context`` (two patches of torch's internals, not made), or a
graph pass dropping that round trip in every graph (AOTAutograd's forward-loss-backward
graph, compiled autograd's), which ``aot_eager`` would not run and which would have to
tell autograd's cast from a user's own.
``tests/collectives/test_grad_dtypes.py`` checks torch still cannot declare it.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from . import comm
from .shard_info import SUPPORTED_DTYPES, ShardInfo

__all__ = ["default_reduce_dtype", "keeps_wider_grads", "output_grad_dtypes", "tp_grad_dtype"]


@functools.cache
def keeps_wider_grads() -> bool:
    """Whether this torch's FSDP2 keeps gradients in their parameters' wider
    ``grad_dtype`` (see [Note: wider gradient dtypes]), and autograd lets ours do so."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:
        return False
    return hasattr(FSDPParam, "unsharded_grad_dtype") and hasattr(
        torch.autograd.function.FunctionCtx, "set_output_grad_dtype")


def default_reduce_dtype(orig_dtype: torch.dtype,
                         reduce_dtype: torch.dtype | None) -> torch.dtype | None:
    """The policy's ``reduce_dtype``, or, where it is ``None`` and FSDP2 keeps wider
    gradients, the parameter's own dtype if a backend reduces it (``None``: reduce in
    the param dtype).

    Args:
        orig_dtype: the sharded parameter's dtype (floating).
        reduce_dtype: the mixed-precision policy's ``reduce_dtype``.

    Returns:
        The dtype to build the parameter's ``ShardInfo`` with.
    """
    if reduce_dtype is None and orig_dtype in SUPPORTED_DTYPES and keeps_wider_grads():
        return orig_dtype
    return reduce_dtype


def is_wider(info: ShardInfo) -> bool:
    """Whether ``info``'s gradients accumulate and reduce in a dtype wider than the one
    its parameter computes in (FSDP2's ``_fsdp_params_with_wider_grad_dtype``)."""
    return info.reduce_dtype.itemsize > info.param_dtype.itemsize


def tp_grad_dtype(info: ShardInfo) -> torch.dtype | None:
    """The gradient dtype a tensor-parallel parameter's DTensor declares in eager
    backward, or ``None`` for its own dtype: FSDP2 keeps such a parameter's
    ``grad_dtype`` (``unsharded_grad_dtype``) through backward, so its gradient's
    reduction over the TP mesh (a norm weight's ``Partial``) runs in that dtype.

    Args:
        info: the parameter's shard layout.

    Returns:
        ``info.reduce_dtype`` where it differs from the compute dtype, else ``None``.
    """
    if (torch.compiler.is_compiling() or comm.use_traced_path()
            or info.reduce_dtype == info.param_dtype or not keeps_wider_grads()):
        return None
    return info.reduce_dtype


def output_grad_dtypes(infos: Sequence[ShardInfo], outputs: Sequence[torch.Tensor],
                       trainable: Sequence[bool], tensor_parallel: Sequence[bool]
                       ) -> tuple[torch.dtype | None, ...] | None:
    """What ``UnshardParams`` declares with ``ctx.set_output_grad_dtype``, or ``None``
    where it keeps autograd's default (every gradient cast to its output's dtype).

    Args:
        infos: the group's parameters.
        outputs: their unsharded tensors, the Function's outputs.
        trainable: per parameter, whether it requires a gradient (a frozen output is
            non-differentiable and declares ``None``).
        tensor_parallel: per parameter, whether modules read it through a TP DTensor,
            whose gradient arrives in :func:`tp_grad_dtype`.

    Returns:
        Per output, ``None`` (pass the gradient uncast) or a dtype to cast it to.
    """
    # Eager only: a traced backward's gradients keep their outputs' dtypes.
    if torch.compiler.is_compiling() or not keeps_wider_grads():
        return None
    dtypes = []
    for info, out, train, tp in zip(infos, outputs, trainable, tensor_parallel):
        if not train or (not tp and is_wider(info)):
            dtypes.append(None)
        else:
            dtypes.append((tp_grad_dtype(info) if tp else None) or out.dtype)
    if all(d == out.dtype for d, out, train in zip(dtypes, outputs, trainable) if train):
        return None
    return tuple(dtypes)
