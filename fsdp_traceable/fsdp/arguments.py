"""Checks and normalisation of ``fully_shard``'s arguments, all before any collective."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

try:
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
except ImportError:  # torch 2.11: shard_placement_fn returns Shard(dim) or None only
    ShardPlacementResult = None
from torch.distributed.tensor import Shard


def module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``module`` as a non-empty list of distinct modules (FSDP2 accepts one or a list).

    Args:
        module: what was passed to ``fully_shard``.

    Returns:
        The modules that share one parameter group.
    """
    if isinstance(module, nn.Module):
        return [module]
    if isinstance(module, (list, tuple)):
        modules = list(module)
        if not modules:
            raise ValueError("module is an empty list: pass an nn.Module or a non-empty list of them")
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise TypeError(
                    f"module[{i}] must be an nn.Module, got {type(m).__name__}: pass an "
                    "nn.Module or a list of them"
                )
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("module lists one module twice: pass each module once")
        return modules
    raise TypeError(
        f"module must be an nn.Module or a list of nn.Modules, got {type(module).__name__}"
    )


def reshard_after_forward_flag(value: object, mesh: DeviceMesh) -> bool | int | None:
    """FSDP2's ``reshard_after_forward``, checked and normalized.

    An int is the size of the group to reshard to after forward: 1 means ``False``
    (FSDP2 warns the same), the shard dimension's size means ``True``, and any other
    divisor of it stays an int.

    Args:
        value: the argument as passed.
        mesh: the group's mesh (its last dim is the shard dim).

    Returns:
        ``None`` (``True`` for non-root groups, ``False`` for the root), a bool, or the
        post-forward group size.
    """
    if value is None or isinstance(value, bool):
        return value
    if not isinstance(value, int):
        raise TypeError(
            f"reshard_after_forward must be None, a bool or an int, got "
            f"{type(value).__name__} {value!r}"
        )
    shard_size = mesh.size(mesh.ndim - 1)
    if value < 1 or value > shard_size or shard_size % value != 0:
        raise ValueError(
            f"reshard_after_forward={value} must be a factor of the shard mesh size "
            f"{shard_size} (or a bool)"
        )
    if value == 1:
        warnings.warn(
            "reshard_after_forward=1 (int) means resharding parameters to world size 1, "
            "instead of reshard_after_forward=True (bool)", stacklevel=3,
        )
        return False
    return True if value == shard_size else value


def check_offload_policy(offload_policy: object) -> bool:
    """Whether ``offload_policy`` offloads to CPU; rejects anything but torch's policies.

    Args:
        offload_policy: ``OffloadPolicy()`` (no offload) or ``CPUOffloadPolicy(...)``.

    Returns:
        ``True`` for a ``CPUOffloadPolicy``.
    """
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(
            "offload_policy must be a torch.distributed.fsdp.OffloadPolicy (OffloadPolicy() "
            f"or CPUOffloadPolicy()), got {type(offload_policy).__name__}"
        )
    return isinstance(offload_policy, CPUOffloadPolicy)


def ignored_param_ids(ignored_params: object) -> set[int]:
    """The ids of ``ignored_params`` (a set or other iterable of parameters, or None).

    Args:
        ignored_params: parameters to leave unsharded and unmanaged.

    Returns:
        Their ``id``s.
    """
    if ignored_params is None:
        return set()
    if isinstance(ignored_params, nn.Parameter) or not isinstance(ignored_params, Iterable):
        raise TypeError(
            "ignored_params must be a set of nn.Parameters, got "
            f"{type(ignored_params).__name__}: wrap it as {{param}}"
        )
    params = list(ignored_params)
    for param in params:
        if not isinstance(param, nn.Parameter):
            raise TypeError(
                f"ignored_params must hold nn.Parameters, got a {type(param).__name__}"
            )
    return {id(p) for p in params}


def shard_placement(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    shard_placement_fn: Callable[[nn.Parameter], object] | None,
) -> int:
    """The shard dim ``shard_placement_fn`` chooses for ``param`` (0 by default).

    Args:
        fqn: the parameter's name, for messages.
        param: the (unsharded) parameter.
        mesh: ``fully_shard``'s mesh.
        shard_placement_fn: returns ``Shard(dim)``, ``None`` or a ``ShardPlacementResult``
            (supported when its mesh is ``fully_shard``'s mesh).

    Returns:
        The dim, in ``[-param.ndim, param.ndim)``.
    """
    if shard_placement_fn is None:
        return 0
    placement = shard_placement_fn(param)
    if ShardPlacementResult is not None and isinstance(placement, ShardPlacementResult):
        if placement.mesh_info.mesh is not mesh:
            raise NotImplementedError(
                f"shard_placement_fn returned a ShardPlacementResult for parameter {fqn!r} "
                "with a mesh other than fully_shard's: per-parameter meshes are not "
                "supported; return Shard(dim) or None, or apply fully_shard with that mesh "
                "to a module holding only those parameters"
            )
        placement = placement.placement
    if placement is None:
        return 0
    if not isinstance(placement, Shard):
        raise TypeError(
            f"shard_placement_fn returned {placement!r} for parameter {fqn!r}; "
            "return a torch.distributed.tensor.Shard(dim) or None (for Shard(0))"
        )
    if param.ndim and not -param.ndim <= placement.dim < param.ndim:
        raise ValueError(
            f"shard_placement_fn returned Shard({placement.dim}) for parameter {fqn!r} of "
            f"size {tuple(param.shape)}; return Shard(d) with {-param.ndim} <= d < {param.ndim}"
        )
    return placement.dim
