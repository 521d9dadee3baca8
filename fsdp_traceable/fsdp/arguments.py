"""Checks and normalisation of ``fully_shard``'s arguments, all before any collective.

Where FSDP2 rejects an input, these raise its exception type (``docs/errors.md`` lists
both, per case). Where FSDP2 only crashes on it (an ``AttributeError`` reading an
attribute the argument lacks, an ``IndexError``), the exception is both that type and
the conventional one, so ``except`` clauses written for either keep working.
"""

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
from torch.distributed.tensor import DTensor, Shard


class ArgumentTypeError(TypeError, AttributeError):
    """An argument of the wrong type. Also an ``AttributeError``: FSDP2 raises one for
    it, reading an attribute the argument lacks (``mesh.ndim``, ``module.modules``)."""


class EmptyModuleListError(ValueError, IndexError):
    """``fully_shard([])``. Also an ``IndexError``: FSDP2 raises one, indexing the list."""


class ShardingOrderError(ValueError, TypeError):
    """``fully_shard`` on a module whose parameters a parent's call already sharded.
    Also a ``TypeError``: FSDP2 raises one, finding no state for those parameters."""


def module_list(module: nn.Module | list[nn.Module]) -> list[nn.Module]:
    """``module`` as a non-empty list of distinct modules (FSDP2 accepts one or a list).

    Args:
        module: what was passed to ``fully_shard``.

    Returns:
        The modules that share one parameter group.
    """
    if isinstance(module, nn.Module):
        if (isinstance(module, (nn.ModuleList, nn.ModuleDict))
                and type(module).forward is nn.Module.forward):
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: "
                f"module is an nn.{type(module).__name__}, which is never called; apply "
                "fully_shard to each module in it (e.g. each block), or pass them together "
                "as a list (fully_shard(list(container)))"
            )
        return [module]
    if isinstance(module, (list, tuple)):
        modules = list(module)
        if not modules:
            raise EmptyModuleListError(
                "module is an empty list: pass an nn.Module or a non-empty list of them"
            )
        for i, m in enumerate(modules):
            if not isinstance(m, nn.Module):
                raise ArgumentTypeError(
                    f"module[{i}] must be an nn.Module, got {type(m).__name__}: pass an "
                    "nn.Module or a list of them"
                )
        if len({id(m) for m in modules}) != len(modules):
            raise ValueError("module lists one module twice: pass each module once")
        return modules
    raise ArgumentTypeError(
        f"module must be an nn.Module or a list of nn.Modules, got {type(module).__name__}"
    )


def check_mesh(mesh: object, has_dp_mesh_dims: bool) -> DeviceMesh:
    """``mesh`` if ``fully_shard`` can shard on it: a 1-D mesh, or a 2-D one with dim
    names (HSDP: replicate, shard); with ``dp_mesh_dims``, the data-parallel mesh
    derived from them (named by construction).

    Args:
        mesh: the ``mesh`` argument (or the default mesh).
        has_dp_mesh_dims: whether ``dp_mesh_dims`` was given.

    Returns:
        ``mesh``.
    """
    if not isinstance(mesh, DeviceMesh):
        raise ArgumentTypeError(
            f"mesh must be a DeviceMesh, got {type(mesh).__name__}: pass "
            "init_device_mesh(device_type, (world_size,)), or None for every rank on the "
            "default device"
        )
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({mesh.ndim}-D): "
            "pass a 1-D mesh (FSDP) or a 2-D one with dims (replicate, shard) (HSDP)"
        )
    if mesh.ndim == 2 and mesh.mesh_dim_names is None and not has_dp_mesh_dims:
        raise AssertionError(
            "Please init the 2D mesh for HSDP with mesh_dim_names specified: mesh is 2-D "
            f"{tuple(mesh.shape)} (HSDP) without dim names; build it with "
            "init_device_mesh(device_type, (replicas, shards), mesh_dim_names=('replicate', "
            "'shard'))"
        )
    return mesh


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
        raise ValueError(  # FSDP2's type
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
    """The shard dim ``shard_placement_fn`` chooses for ``param`` (0 by default),
    checked as FSDP2 checks it, in its order and with its exception types.

    Args:
        fqn: the parameter's name, for messages.
        param: the (unsharded) parameter.
        mesh: ``fully_shard``'s mesh.
        shard_placement_fn: returns ``Shard(dim)``, ``None`` or a ``ShardPlacementResult``
            (supported when its mesh is ``fully_shard``'s mesh).

    Returns:
        The dim, in ``[-param.ndim, param.ndim)``.
    """
    placement = shard_placement_fn(param) if shard_placement_fn is not None else None
    if ShardPlacementResult is not None and isinstance(placement, ShardPlacementResult):
        if placement.mesh_info.mesh is not mesh:
            raise NotImplementedError(
                f"shard_placement_fn returned a ShardPlacementResult for parameter {fqn!r} "
                "with a mesh other than fully_shard's: per-parameter meshes are not "
                "supported; return Shard(dim) or None, or apply fully_shard with that mesh "
                "to a module holding only those parameters"
            )
        placement = placement.placement
    if placement is not None and not isinstance(placement, Shard):
        raise ValueError(
            f"Invalid shard_placement_fn result: {placement!r} for parameter {fqn!r}; "
            "return a torch.distributed.tensor.Shard(dim) or None (for Shard(0))"
        )
    if not param.is_contiguous():
        raise NotImplementedError(
            f"FSDP does not support non-contiguous parameters: parameter {fqn!r} of size "
            f"{tuple(param.shape)} has strides {param.stride()}; make it contiguous before "
            "fully_shard (e.g. param.data = param.data.contiguous(), or no channels_last)"
        )
    dim = 0 if placement is None else placement.dim
    if not -param.ndim <= dim < param.ndim:
        raise AssertionError(  # FSDP2's type
            f"Shard dim {dim} is invalid for {param.ndim}D tensor: shard_placement_fn returned "
            f"Shard({dim}) for parameter {fqn!r} of size {tuple(param.shape)}; return "
            f"Shard(d) with {-param.ndim} <= d < {param.ndim}"
        )
    _check_even_shards(fqn, param, mesh, dim % param.ndim)
    return dim


def _check_even_shards(fqn: str, param: nn.Parameter, mesh: DeviceMesh, dim: int) -> None:
    """Raises FSDP2's ``NotImplementedError`` for a shard dim other than 0 that the
    shard mesh does not divide (a TP parameter's shards are of its local tensor)."""
    shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
    world_size = mesh.size(mesh.ndim - 1)
    if dim > 0 and shape[dim] % world_size != 0:
        raise NotImplementedError(
            f"FSDP does not support uneven sharding on dim {dim}: parameter {fqn!r}: "
            f"Shard({dim}) of size {tuple(shape)} needs size({dim})={shape[dim]} divisible "
            f"by the shard mesh size {world_size}; shard it on dim 0 instead "
            "(shard_placement_fn returning Shard(0) or None), which may be uneven"
        )
