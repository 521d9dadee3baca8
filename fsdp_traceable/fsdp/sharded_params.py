"""How ``fully_shard`` turns one parameter into its shard: the shard layout
(:class:`~fsdp_traceable.collectives.ShardInfo`) and the sharded ``nn.Parameter(DTensor)``
laid out as FSDP2 lays it out."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..collectives import ShardInfo, make_shard_info, shard_tensor
from ..collectives.grad_dtypes import default_reduce_dtype
from ..collectives.shard_info import SUPPORTED_DTYPES
from .features.tensor_parallel import TensorParallelLayout


def shard_info(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    shard_dim: int,
    offload_to_cpu: bool,
) -> ShardInfo:
    """One parameter's shard layout on ``mesh``'s shard dim.

    Args:
        fqn: the parameter's name, for errors.
        param: the parameter (a TP parameter: a DTensor, sharded as its local tensor).
        mesh: the group's 1-D or 2-D (HSDP) mesh.
        mp_policy: the group's mixed-precision policy.
        shard_dim: the dim to shard.
        offload_to_cpu: whether the shards live on CPU.

    Returns:
        The parameter's ``ShardInfo``.
    """
    # A TP parameter's FSDP shards are of its local tensor (see [Note: TP parameters]).
    shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
    return shard_info_in_dtype(
        fqn, shape, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1),
        param.dtype, param.requires_grad, mp_policy, shard_dim=shard_dim,
        offload_to_cpu=offload_to_cpu)


def shard_info_in_dtype(
    fqn: str,
    shape: torch.Size,
    world_size: int,
    rank: int,
    dtype: torch.dtype,
    requires_grad: bool,
    mp_policy: MixedPrecisionPolicy,
    *,
    shard_dim: int,
    offload_to_cpu: bool,
) -> ShardInfo:
    """A parameter's shard layout in ``dtype``, with FSDP2's dtypes for it.

    As FSDP2's ``FSDPParam.init_dtype_attrs``: the policy's ``param_dtype`` applies to
    floating parameters only (float8 included); any other dtype (a frozen integer
    parameter) is all-gathered as is. A parameter of a dtype no backend reduces
    (integer, float8 without a ``param_dtype``) must be frozen: its gradient could not
    be reduced.

    Args:
        fqn: the parameter's name, for errors.
        shape: the sharded tensor's global shape.
        world_size: ranks of the shard group.
        rank: this rank in it.
        dtype: the parameter's dtype.
        requires_grad: whether the parameter trains.
        mp_policy: the group's mixed-precision policy.
        shard_dim: the dim to shard.
        offload_to_cpu: whether the shards live on CPU.

    Returns:
        The parameter's ``ShardInfo``.

    Raises:
        TypeError: naming the parameter: a dtype the policy's dtypes cannot be cast
            from, or a trainable parameter whose gradient no backend reduces.
        ValueError: naming the parameter: a shard layout ``make_shard_info`` refuses.
    """
    param_dtype = mp_policy.param_dtype if dtype.is_floating_point else None
    # See [Note: wider gradient dtypes].
    reduce_dtype = (default_reduce_dtype(dtype, mp_policy.reduce_dtype)
                    if dtype.is_floating_point else None)
    try:
        info = make_shard_info(
            shape, world_size, rank, shard_dim=shard_dim, orig_dtype=dtype,
            param_dtype=param_dtype, reduce_dtype=reduce_dtype, offload_to_cpu=offload_to_cpu,
        )
    except (TypeError, ValueError) as err:
        raise type(err)(f"parameter {fqn!r}: {err}") from None
    if requires_grad and info.reduce_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"parameter {fqn!r}: requires_grad=True with dtype {dtype}, whose gradient "
            f"no backend reduces: FSDP reduces gradients of dtype "
            f"{', '.join(map(str, SUPPORTED_DTYPES))}. Freeze it "
            "(requires_grad_(False)), or give the group an mp_policy with a "
            "param_dtype and reduce_dtype among those"
        )
    return info


def sharded_param(
    param: nn.Parameter,
    info: ShardInfo,
    mesh: DeviceMesh,
    is_hsdp: bool,
    device: torch.device,
    pin_memory: bool,
    tp_layout: TensorParallelLayout | None,
) -> nn.Parameter:
    """The sharded ``nn.Parameter(DTensor)`` for ``param``, laid out as FSDP2 lays it out.

    Args:
        param: the unsharded parameter.
        info: its shard layout (from :func:`shard_info`).
        mesh: the group's mesh.
        is_hsdp: whether ``mesh`` is 2-D (replicate, shard).
        device: where the shard lives.
        pin_memory: pin a CPU shard.
        tp_layout: a TP parameter's layout (see [Note: TP parameters]), else ``None``.

    Returns:
        The sharded parameter, with ``param``'s ``requires_grad``.
    """
    data = param._local_tensor if isinstance(param, DTensor) else param
    local = shard_tensor(data.detach().to(device), info)
    if pin_memory and device.type == "cpu":
        local = pinned(local)
    if tp_layout is not None:
        mesh, placements = tp_layout.spmd_mesh, tp_layout.spmd_placements
    else:
        shard = Shard(info.shard_dim)
        placements = (Replicate(), shard) if is_hsdp else (shard,)
    dtensor = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride(),
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def pinned(local: torch.Tensor) -> torch.Tensor:
    """``local`` in pinned host memory. Pinning needs an accelerator: without one torch
    raises ``RuntimeError``, as under FSDP2 (at ``fully_shard``, or at ``to_empty`` for
    parameters built on meta); the same type, saying which argument to change."""
    try:
        return local.pin_memory()
    except RuntimeError as err:
        raise RuntimeError(
            f"CPUOffloadPolicy(pin_memory=True) could not pin the sharded parameters in host "
            f"memory ({err}): pinning needs an accelerator; pass "
            "CPUOffloadPolicy(pin_memory=False) on a machine without one"
        ) from err


def check_replacement(fqn: str, old: nn.Parameter, new: nn.Parameter | None) -> None:
    """Raises unless ``new`` can take the place of the sharded parameter ``old``.

    See [Note: replaced parameters].

    Args:
        fqn: the parameter's name in its group, for the message.
        old: the sharded parameter ``fully_shard`` made (or the last one adopted).
        new: what the module attribute is being set to.

    Raises:
        TypeError: ``new`` is not an ``nn.Parameter`` wrapping a ``DTensor``.
        ValueError: its mesh, placements, shape, stride, local shape, dtype or device
            (unless ``old`` is on meta) differ from ``old``'s.
    """
    fix = ("build the new parameter with the old one's layout, e.g. nn.Parameter("
           "distribute_tensor(full, old.device_mesh, old.placements)), or copy the values "
           "into the sharded parameter in place (with torch.no_grad(): old.copy_(new))")
    if not isinstance(new, nn.Parameter) or not isinstance(new, DTensor):
        what = "None" if new is None else f"a {type(new).__name__} of shape {tuple(new.shape)}"
        raise TypeError(
            f"parameter {fqn!r} of a fully_shard-ed module was set to {what}; fully_shard "
            f"manages it as an nn.Parameter(DTensor) sharded on its mesh: {fix}"
        )
    # A parameter still on meta takes a materialized one (torch's set_model_state_dict
    # loads into a meta-built model with assign=True).
    device = new._local_tensor.device if old.is_meta else old._local_tensor.device
    layout = (old.device_mesh, old.placements, old.shape, old.stride(), old.dtype,
              old._local_tensor.shape, device)
    given = (new.device_mesh, new.placements, new.shape, new.stride(), new.dtype,
             new._local_tensor.shape, new._local_tensor.device)
    if layout != given:
        names = ("mesh", "placements", "shape", "stride", "dtype", "local shape", "device")
        diffs = [f"{n} {g} (expected {e})" for n, e, g in zip(names, layout, given) if e != g]
        raise ValueError(
            f"parameter {fqn!r} of a fully_shard-ed module was replaced by a DTensor laid "
            f"out differently: {', '.join(diffs)}; {fix} (module.to(dtype) changes the "
            "dtype of every parameter)"
        )
