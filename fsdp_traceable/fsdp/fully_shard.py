"""``fully_shard``: FSDP2's API on top of the traceable collectives."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor import Shard
from torch.utils.weak import WeakIdKeyDictionary

from .. import _torch_patches
from ..collectives.shard_info import SUPPORTED_DTYPES
from . import activation_checkpointing, autograd_bridge, forward_regions, stale_optimizers
from .arguments import (
    ShardingOrderError,
    ShardPlacementResult,
    check_mesh,
    check_offload_policy,
    ignored_param_ids,
    module_list,
    reshard_after_forward_flag,
)
from .class_swap import fsdp_class, swap_class
from .features.tensor_parallel import data_parallel_mesh
from .fsdp_module import FSDPModule
from .group_settings import GroupSettings
from .module_state import arm_shared_param_check, register_state, replicated, state_of
from .param_group import ParamGroup
from .param_shards import ParamShards
from .root_state import RootState
from .unsharded_binding import owner_class

if TYPE_CHECKING:  # torch 2.12+; torch 2.11 has no dp_mesh_dims
    from torch.distributed.fsdp import DataParallelMeshDims

log = logging.getLogger(__name__)

# The original (unsharded) parameters every fully_shard call replaced: a weight tied
# across two calls is still the original object in the module sharded second.
# Process-wide and keyed by the parameter object itself, held weakly: an entry lives
# only while something still holds the replaced parameter (a module not sharded yet
# that shares it), and a parameter belongs to one model.
_replaced_params = WeakIdKeyDictionary()
# Marks the sharded parameters fully_shard created (an attribute, not a weak
# reference: module.to_empty() swaps parameters, which weak references forbid):
# finding one again means a parent was sharded before its child.
_SHARDED_MARK = "_fsdp_traceable_sharded"


def fully_shard(
    module: nn.Module | list[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable[[nn.Parameter], Shard | ShardPlacementResult | None] | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
    dp_mesh_dims: DataParallelMeshDims | None = None,
) -> nn.Module | list[nn.Module]:
    """Shards ``module``'s parameters across ``mesh``; a drop-in for FSDP2's ``fully_shard``.

    Apply bottom-up (blocks first, then the root). The parameters of ``module`` not
    already managed by a ``fully_shard``-ed submodule form one group: one all-gather
    in forward, one reduce-scatter in backward. They become ``nn.Parameter``s
    wrapping ``DTensor``s laid out as FSDP2 lays them out.

    Args:
        module: the module to shard, or a list of modules that share one group (its
            all-gather runs before the first of them); each module's class is swapped
            for an ``FSDP<cls>`` subclass.
        mesh: a 1-D mesh (FSDP) or 2-D mesh with named dims (replicate, shard) (HSDP);
            default: every rank on the default device.
        reshard_after_forward: free the unsharded parameters after forward and
            all-gather them again in backward. ``None``: ``True`` except for the root
            group (the module ``fully_shard`` is applied to last). An int is the group
            size to reshard to: 1 (as ``False``), the shard mesh size (as ``True``), or
            another divisor of it: eager backward then re-gathers over that many ranks
            from a piece kept after forward (compiled, this raises).
        shard_placement_fn: maps a parameter to ``Shard(dim)``, ``None`` (``Shard(0)``)
            or a ``ShardPlacementResult`` on ``mesh``.
        mp_policy: the mixed-precision policy (torch's ``MixedPrecisionPolicy``).
        offload_policy: ``OffloadPolicy()`` (none) or ``CPUOffloadPolicy(pin_memory=...)``:
            sharded parameters, gradients and so optimizer state on CPU.
        ignored_params: parameters left unsharded and unmanaged (no all-gather, no
            gradient reduction), as in FSDP2.
        dp_mesh_dims: FSDP2's (torch 2.12+) ``DataParallelMeshDims``: ``mesh`` is then
            the full SPMD mesh, every parameter a DTensor on it with ``Replicate()`` on
            the dp dims, which are ``shard`` (one dim) and optionally ``replicate``
            (HSDP). Without it, tensor-parallel parameters compose as with FSDP2: pass
            the dp slice (e.g. ``mesh["dp"]``) after ``parallelize_module`` on
            ``mesh["tp"]``.

    Returns:
        ``module`` (or the list), each module now also an :class:`FSDPModule`.
    """
    spmd = None
    if dp_mesh_dims is not None:
        if not isinstance(mesh, DeviceMesh):
            raise ValueError(
                "fully_shard(dp_mesh_dims=...) needs mesh= the full SPMD DeviceMesh the "
                f"parameters are DTensors on, got {type(mesh).__name__}"
            )
        spmd = (mesh, dp_mesh_dims)
        mesh = data_parallel_mesh(mesh, dp_mesh_dims)
    modules = module_list(module)
    for m in modules:
        if isinstance(m, TorchFSDPModule):  # ours or torch's
            which = "it" if isinstance(m, FSDPModule) else "torch's fully_shard (FSDP2)"
            raise AssertionError(  # FSDP2's type
                "Each distinct composable distributed API can only be applied to a module "
                f"once. fully_shard can only be applied to a module once, and this "
                f"{type(m).__name__} already has {which}: apply one fully_shard "
                "once per module (modules that share parameters go in one call, "
                "fully_shard([module_a, module_b]))"
            )
    mesh = check_mesh(mesh if mesh is not None else _default_mesh(), spmd is not None)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy")
    _check_mp_dtypes(mp_policy)
    reshard = reshard_after_forward_flag(reshard_after_forward, mesh)
    offload_to_cpu = check_offload_policy(offload_policy)
    ignored = ignored_param_ids(ignored_params)
    owned, shared = _managed_params(modules, ignored)
    _patch_torch()
    partial_reshard = None if isinstance(reshard, bool) or reshard is None else reshard
    params = ParamShards(
        [(fqn, param) for fqn, param, _ in owned], mesh, mp_policy=mp_policy,
        shard_placement_fn=shard_placement_fn, offload_to_cpu=offload_to_cpu,
        pin_memory=offload_to_cpu and offload_policy.pin_memory, spmd=spmd,
        partial_reshard=partial_reshard,
    )
    settings = GroupSettings(mesh, reshard_after_forward=reshard)
    group = ParamGroup(params, settings, modules=modules)
    if log.isEnabledFor(logging.DEBUG):
        _log_group(group, modules, reshard)
    for _, param, _ in owned:
        _replaced_params[param] = True
    stale_optimizers.watch(_replaced_params)
    _torch_patches.drop_mesh_hash_from_pickles(
        mesh, *(spmd[:1] if spmd is not None else ()),
        *{id(p.device_mesh): p.device_mesh for p in group.params.sharded_params}.values())
    for sharded in group.params.sharded_params:
        setattr(sharded, _SHARDED_MARK, True)
    owner_names: dict[int, tuple[nn.Module, list[str]]] = {}
    # group.params.sharded_params[i] is the sharded owned[i].
    for index, ((_, _, owners), sharded) in enumerate(zip(owned, group.params.sharded_params)):
        for owner, name in owners:
            owner._parameters[name] = sharded
            group.add_holder(owner, name, index)
            owner_names.setdefault(id(owner), (owner, []))[1].append(name)
    roots = {id(m) for m in modules}
    for owner, names in owner_names.values():
        if id(owner) not in roots:
            swap_class(owner, owner_class(type(owner), tuple(names)))
    register_state(modules, group).shared_params = shared
    for m in modules:
        swap_class(m, fsdp_class(type(m), tuple(owner_names.get(id(m), (None, []))[1])))
        forward_regions.register(m)
    if len(modules) == 1:
        _link_groups(modules[0])
    return module


# As FSDP2's: fully_shard.state(module) is the module's state (see module_state).
fully_shard.state = state_of


def _patch_torch() -> None:
    """See [Note: torch patches]: what ``fully_shard`` modules need of torch, applied by
    every ``fully_shard`` call (again: no change), never by importing the package."""
    autograd_bridge.patch_torch()
    forward_regions.patch_torch()


def _log_group(group: ParamGroup, modules: list[nn.Module], reshard: bool | int | None) -> None:
    """Debug log: one ``fully_shard`` call's group (``TORCH_LOGS="+fsdp_traceable"``)."""
    params = ", ".join(f"{fqn} {tuple(info.global_size)}->{tuple(info.sharded_size)}"
                       for fqn, info in zip(group.params.fqns, group.params.infos))
    log.debug(
        "fully_shard(%s): group of %d parameters (%d elements, %s): %s; mesh %s "
        "(%s); reshard_after_forward=%s; mp_policy param_dtype=%s reduce_dtype=%s; "
        "offload_to_cpu=%s",
        ", ".join(type(m).__name__ for m in modules), len(group.params.infos),
        sum(info.global_numel for info in group.params.infos),
        ", ".join(sorted({str(p.dtype) for p in group.params.sharded_params})) or "no dtype",
        params or "none", tuple(group.params.mesh.shape),
        "HSDP (replicate, shard)" if group.params.is_hsdp else "FSDP",
        "default (True except the root)" if reshard is None else reshard,
        group.params.mp_policy.param_dtype, group.params.mp_policy.reduce_dtype, group.params.offload_to_cpu,
    )


def _managed_params(
    modules: list[nn.Module], ignored: set[int]
) -> tuple[list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]], list[str]]:
    """``(fqn, param, [(owner, name), ...])`` for each parameter this call manages, and
    the paths of those it leaves to another call's group.

    FSDP2's order: each module's submodules outside other ``fully_shard`` calls,
    children before parents, modules in list order; ``ignored`` (parameter ids) are
    left out, and so are parameters another ``fully_shard`` call already manages (see
    [Note: shared parameters across groups]). With several modules, names are
    prefixed with the module's list index.
    """
    managed: dict[int, tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]] = {}
    shared: dict[int, str] = {}
    sharded_elsewhere: set[int] = set()
    for module in modules:
        for sub in module.modules():
            if sub is not module and isinstance(sub, FSDPModule):
                sharded_elsewhere.update(id(p) for p in sub.parameters())
    prefixes = [f"{i}." if len(modules) > 1 else "" for i in range(len(modules))]
    for module, module_prefix in zip(modules, prefixes):
        for prefix, owner in _modules_outside_fsdp(module, module_prefix):
            for name, param in owner._parameters.items():
                if param is None or id(param) in ignored:
                    continue
                fqn = f"{prefix}{name}"
                if getattr(param, _SHARDED_MARK, False):
                    raise ShardingOrderError(
                        f"parameter {fqn!r} was already sharded by fully_shard on a parent "
                        "module; apply fully_shard bottom-up: submodules first, then their "
                        "parents, the root last"
                    )
                if id(param) in sharded_elsewhere or param in _replaced_params:
                    shared.setdefault(id(param), fqn)  # the root's first forward raises
                    continue
                if param.ndim == 0:
                    raise ValueError(
                        f"fully_shard doesn't support scalar parameters: {fqn!r} is 0-dim. "
                        f"Change {fqn} to a 1D tensor with numel equal to 1 (e.g. "
                        "nn.Parameter(p.reshape(1))), or leave it out with ignored_params"
                    )
                managed.setdefault(id(param), (fqn, param, []))[2].append((owner, name))
    params = list(managed.values())
    by_device = {param.device.type: fqn for fqn, param, _ in params}
    if len(by_device) > 1:
        listed = ", ".join(f"{fqn!r} on {device}" for device, fqn in sorted(by_device.items()))
        raise ValueError(
            f"module has parameters on several device types ({listed}); move the module "
            "to one device before fully_shard (e.g. module.to('cpu'))"
        )
    by_dtype = {param.dtype: fqn for fqn, param, _ in params if param.requires_grad}
    if len(by_dtype) > 1:
        listed = ", ".join(f"{fqn!r} is {dtype}" for dtype, fqn in by_dtype.items())
        raise ValueError(
            f"trainable parameters of one fully_shard group have several dtypes ({listed}); "
            "their gradients are reduced in one bucket of one dtype: give them one dtype "
            "(e.g. module.float(); use mp_policy for lower-precision compute), or apply "
            "fully_shard to the submodules of each dtype separately"
        )
    return params, list(shared.values())


def _modules_outside_fsdp(module: nn.Module, prefix: str = ""):
    """``(prefix, submodule)`` for ``module`` and every submodule not under another
    ``fully_shard`` or torch's ``replicate`` (see [Note: replicate and fully_shard]),
    children before their parent: FSDP2's order, so a bucket's layout, and with it the
    reduce-scatter's summation order per element, matches FSDP2's."""
    for name, child in module._modules.items():
        if child is None or isinstance(child, FSDPModule) or replicated(child):
            continue
        yield from _modules_outside_fsdp(child, f"{prefix}{name}.")
    yield prefix, module


def _link_groups(root: FSDPModule) -> None:
    """Makes ``root`` (the latest ``fully_shard`` call, applied bottom-up) the root.

    By default the root group does not reshard after forward (its backward starts
    right after); an explicit ``reshard_after_forward=True`` on it is honoured, as
    FSDP2 does. The groups' module order (pre-order, i.e. forward order for the
    usual blocks-in-sequence models; a group of several modules counted once, at
    its first module) drives the eager prefetch: each group's forward prefetches
    the next group, each group's backward the previous one. Doing this at
    ``fully_shard`` time, not lazily in the first forward, keeps the compiled
    forward free of first-call branches (and their recompile). The groups share one
    :class:`RootState` (see [Note: per-model state]).
    """
    named = [(path, m) for path, m in root.named_modules() if isinstance(m, FSDPModule)]
    fsdp_modules = [m for _, m in named]
    groups = list({id(m._fsdp_group): m._fsdp_group for m in fsdp_modules}.values())
    names = {}
    for path, m in reversed(named):  # a group of several modules: named for its first
        names[id(m._fsdp_group)] = path
    position = {id(g): i for i, g in enumerate(groups)}
    for m in fsdp_modules:
        i = position[id(m._fsdp_group)]
        if not m._fsdp_group.settings.explicit_forward_prefetch:
            state_of(m).next_groups = groups[i + 1 : i + 2]
    for module in activation_checkpointing.inside_checkpoint_wrappers(root, FSDPModule):
        module._fsdp_group.configure(inside_checkpoint_wrapper=True)
    arm_shared_param_check(root)
    root_state = RootState()
    list_groups = [g for g in groups[1:] if len(g.modules) > 1]
    for i, group in enumerate(groups):
        # groups[0] is the root, which by default keeps its parameters unsharded
        # from forward through backward, so nothing prefetches it.
        previous = groups[i - 1] if i > 1 else None
        group.link(name=names[id(group)], is_root=i == 0,
                   prefetch_backward=previous.prefetch if previous is not None else None,
                   root_state=root_state, list_groups=list_groups if i == 0 else [])
    if log.isEnabledFor(logging.DEBUG):
        _log_order(root, groups, fsdp_modules)


def _log_order(root: FSDPModule, groups: list[ParamGroup], fsdp_modules: list[FSDPModule]
               ) -> None:
    """Debug log: the root, each group's reshard-after-forward and its prefetches, groups
    named by their module path under the root (the root by its class)."""
    log.debug("fully_shard(%s) links %d groups below it, itself the root until a "
              "fully_shard on a parent links them again", type(root).__name__, len(groups))
    next_groups = {id(m._fsdp_group): m._fsdp_next_groups for m in fsdp_modules}
    for i, group in enumerate(groups):
        previous = groups[i - 1] if i > 1 else None
        log.debug(
            "group %s%s: reshard_after_forward=%s; forward prefetches %s; backward "
            "prefetches %s", group.log_name, " (root)" if group.settings.is_root else "",
            group.settings.reshard_after_forward, [g.log_name for g in next_groups[id(group)]],
            "as set explicitly" if group.settings.explicit_backward_prefetch
            else [previous.log_name] if previous is not None else [],
        )


def _check_mp_dtypes(mp_policy: MixedPrecisionPolicy) -> None:
    """Rejects policy dtypes the collectives cannot carry, before any parameter is read."""
    supported = ", ".join(map(str, SUPPORTED_DTYPES))
    for field in ("param_dtype", "reduce_dtype"):
        dtype = getattr(mp_policy, field)
        if dtype is not None and dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"mp_policy.{field}={dtype} is not supported: use one of {supported}, or "
                "None to keep each parameter's own dtype"
            )
    output_dtype = mp_policy.output_dtype
    if output_dtype is not None and not (
        isinstance(output_dtype, torch.dtype) and output_dtype.is_floating_point
    ):
        raise TypeError(
            f"mp_policy.output_dtype={output_dtype} is not a floating-point dtype: use "
            "e.g. torch.float32, or None to leave the outputs as computed"
        )


def _default_mesh() -> DeviceMesh:
    if not torch.distributed.is_initialized():
        raise ValueError(
            "fully_shard needs an initialized process group when mesh is None: call "
            "torch.distributed.init_process_group first, or pass mesh="
        )
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device_type, (torch.distributed.get_world_size(),))
