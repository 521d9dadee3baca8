"""What one ``fully_shard`` call's parameter group holds: its sharded parameters, the
modules they are bound to, and the mesh they are sharded on (FSDP2's ``FSDPParam``
list and ``FSDPMeshInfo``). The group (:class:`~.param_group.ParamGroup`) decides when
to gather and bind them; this class knows how.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_device_from_mesh
from torch.distributed.tensor import DTensor

from ..collectives import ShardInfo
from ..collectives.bucket_layout import BucketLayout
from ..collectives.grad_dtypes import tp_grad_dtype
from ..collectives.validation import check_bucket_bytes
from .arguments import shard_placement
from .features.all_gather_extensions import (
    AllGatherExtension,
    detect_extension,
    plain_without_hooks,
    plain_without_hooks_all,
)
from .features.tensor_parallel import TensorParallelLayout, spmd_layout, tensor_parallel_layout
from .sharded_params import (
    check_replacement,
    pinned,
    shard_info,
    shard_info_in_dtype,
    sharded_param,
)
from .unsharded_binding import Binding, bind_unsharded, is_bound, unbind_unsharded

Versions = list[tuple[int, int]]


class ParamShards:
    """The sharded parameters of one group, one :class:`ShardInfo` and one
    ``nn.Parameter(DTensor)`` each, and where they live and communicate.

    Args:
        named_params: the parameters to shard, with their names under the module.
        mesh: the data-parallel mesh (2-D for HSDP: replicate, shard).
        mp_policy: the mixed-precision policy (the all-gather and reduce dtypes).
        shard_placement_fn: ``fully_shard``'s per-parameter shard dim choice.
        offload_to_cpu: whether the shards (and gradients) live on CPU.
        pin_memory: whether offloaded shards are pinned.
        spmd: with ``dp_mesh_dims``, the full mesh the parameters are DTensors on and
            the ``DataParallelMeshDims`` naming ``mesh``'s dims.
        partial_reshard: ``N`` of ``reshard_after_forward=N``, else None.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        *,
        mp_policy: MixedPrecisionPolicy,
        shard_placement_fn: Callable[[nn.Parameter], object] | None,
        offload_to_cpu: bool,
        pin_memory: bool,
        spmd: tuple[DeviceMesh, object] | None,
        partial_reshard: int | None,
    ) -> None:
        self.mesh = mesh
        self.device_type = mesh.device_type
        self.is_hsdp = mesh.ndim == 2
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        self.replicate_group = mesh.get_group(0) if self.is_hsdp else None
        self.device = _get_device_from_mesh(mesh)
        self.mp_policy = mp_policy
        # CPUOffloadPolicy: sharded parameters and gradients live on CPU; the shards
        # are copied to the device before each all-gather.
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory

        # One ShardInfo and one sharded DTensor parameter each; TP parameters also a
        # layout (see [Note: TP parameters]).
        # Each parameter's path under the group's module, and (once the root's fully_shard
        # names the group) under the root, as FSDP2 names them in errors and logs.
        self._local_fqns = [fqn for fqn, _ in named_params]
        self.fqns = list(self._local_fqns)
        self.infos: list[ShardInfo] = []
        self.tp_layouts: list[TensorParallelLayout | None] = []
        for fqn, param in named_params:
            shard_dim = shard_placement(fqn, param, mesh, shard_placement_fn)
            self.tp_layouts.append(_tp_layout(fqn, param, mesh, spmd, shard_dim, partial_reshard))
            self.infos.append(shard_info(fqn, param, mesh, mp_policy, shard_dim, offload_to_cpu))
        check_bucket_bytes(self.infos, self.fqns)
        # The whole group's bucket (see [Note: bucket layouts]); None without parameters.
        self.layout = BucketLayout.of(self.infos) if self.infos else None
        self.sharded_params: list[nn.Parameter] = [
            sharded_param(param, info, mesh, self.is_hsdp, self._shard_device(param),
                          pin_memory, layout)
            for (_, param), info, layout in zip(named_params, self.infos, self.tp_layouts)
        ]
        self.has_tp_params = any(layout is not None for layout in self.tp_layouts)
        # (module, attribute name, parameter index) for every module attribute that
        # holds one of the parameters (a tied weight has several).
        self.bindings: list[Binding] = []
        # Per parameter: the first module holding it (FSDP2 passes it to the pre hook).
        self.first_holders: list[nn.Module | None] = [None] * len(self.sharded_params)
        # Per parameter: its attribute name on that module.
        self.first_names: list[str | None] = [None] * len(self.sharded_params)
        # Per parameter: whether it holds any element (an empty one gets no gradient).
        self.nonempty = tuple(info.global_numel > 0 for info in self.infos)
        _ = self.extensions  # malformed hooks raise now, at fully_shard, as in FSDP2
        # Whether no parameter is on meta (checked before the first all-gather, and
        # again after the parameters are re-read).
        self._materialized = False

    def _shard_device(self, param: nn.Parameter) -> torch.device:
        """Where a sharded parameter lives: meta stays meta (FSDP2 materializes later)."""
        if param.device.type == "meta":
            return param.device
        return torch.device("cpu") if self.offload_to_cpu else self.device

    @property
    def has_trainable(self) -> bool:
        """Whether a backward can reach this group's gradient reduction."""
        return any(p.requires_grad for p in self.sharded_params)

    @property
    def extensions(self) -> list[AllGatherExtension | None]:
        """Per parameter: its all-gather hooks, as its local tensor has them now (looked
        up at every all-gather, as FSDP2 does: hooks may be set after ``fully_shard``)."""
        locals_ = [param._local_tensor for param in self.sharded_params]
        # One check of the whole group first: where Dynamo traces it (every re-gather of
        # a per-block compiled backward), a call per parameter is a frame per parameter.
        if plain_without_hooks_all(locals_):
            return [None] * len(locals_)
        return [
            None if plain_without_hooks(local) else
            detect_extension(fqn, local, info, self.mesh, self.mp_policy, holder)
            for fqn, local, info, holder in zip(
                self.fqns, locals_, self.infos, self.first_holders)
        ]

    def unsharded_layout_key(self, grad_enabled: bool) -> tuple | None:
        """What decides the layout of the unsharded parameters an all-gather returns
        (size, shard dim, dtype, device, ``requires_grad`` per parameter), read from the
        sharded parameters in Python; ``None`` where a parameter has all-gather hooks,
        whose outputs only the hooks decide."""
        if not all(plain_without_hooks(param._local_tensor) for param in self.sharded_params):
            return None
        return tuple(
            (tuple(info.global_size), info.shard_dim, info.param_dtype, self.device,
             grad_enabled and param.requires_grad)
            for info, param in zip(self.infos, self.sharded_params))

    # -- the modules holding the parameters ----------------------------------------------

    def add_binding(self, owner: nn.Module, name: str, index: int) -> None:
        """Records that ``owner.<name>`` is parameter ``index``."""
        self.bindings.append((owner, name, index))
        if self.first_holders[index] is None:
            self.first_holders[index] = owner
            self.first_names[index] = name

    @property
    def is_bound(self) -> bool:
        """Whether unsharded parameters are bound to the modules right now."""
        return is_bound(self.bindings)

    def bind(self, unsharded: tuple[torch.Tensor, ...] | list[torch.Tensor]) -> None:
        """Makes the modules read ``unsharded`` (by parameter index) for their parameters:
        TP parameters as DTensors on their TP mesh (see [Note: TP parameters])."""
        if self.has_tp_params:
            unsharded = [self.bound_value(i, t) for i, t in enumerate(unsharded)]
        bind_unsharded(self.bindings, unsharded)

    def set_module_path(self, path: str) -> None:
        """Names the parameters by their path under the root: ``path`` is the group's
        module path there (``""`` for the root's own group)."""
        prefix = f"{path}." if path else ""
        self.fqns = [prefix + fqn for fqn in self._local_fqns]

    def binding_index(self, owner: nn.Module, name: str) -> int:
        """The index of the parameter ``owner.<name>``."""
        return next(i for o, n, i in self.bindings if o is owner and n == name)

    def bound_value(self, index: int, unsharded: torch.Tensor) -> torch.Tensor:
        """What a module reads for parameter ``index`` bound to ``unsharded``: a TP
        parameter as a DTensor on its TP mesh (see [Note: TP parameters])."""
        layout = self.tp_layouts[index] if self.has_tp_params else None
        if layout is None:
            return unsharded
        return layout.unsharded(unsharded, tp_grad_dtype(self.infos[index]))

    def unbind(self) -> None:
        """Makes the modules read their sharded parameters again."""
        unbind_unsharded(self.bindings)

    # [Note: replaced parameters]
    # ``module.weight = nn.Parameter(...)`` on a module holding a sharded parameter, or
    # ``load_state_dict(assign=True)``, goes through ``register_parameter``, which the
    # classes fully_shard swaps in override (``unsharded_binding.register_parameter``)
    # and hands to the group (``ParamGroup.replace_param``): the new parameter is
    # checked first (an nn.Parameter(DTensor) with the old layout, else
    # TypeError/ValueError, nothing changed), then set on every holder of a tied
    # parameter and adopted here, so the group's next all-gather gathers it. FSDP2
    # adopts it at its lazy init (the first forward) and after load_state_dict; a later
    # replacement it silently reverts at its next unshard, where ours adopts it too.

    def check_replacement(self, owner: nn.Module, name: str, param: nn.Parameter | None) -> int:
        """The index of the parameter ``owner.<name>``, if ``param`` can replace it
        (see [Note: replaced parameters]); raises ``TypeError``/``ValueError`` if not."""
        index = self.binding_index(owner, name)
        check_replacement(self.fqns[index], self.sharded_params[index], param)
        return index

    def replace(self, index: int, param: nn.Parameter,
                register: Callable[[nn.Module, str, nn.Parameter], None]) -> None:
        """Sets parameter ``index`` to ``param`` on every holder (``register(module,
        name, param)`` on each) and adopts it."""
        for holder, holder_name, i in self.bindings:
            if i == index:
                register(holder, holder_name, param)
        self.refresh()

    def refresh(self) -> None:
        """Re-reads the sharded parameters from their modules (after ``module._apply``,
        e.g. ``to_empty``, may have replaced them) and re-pins offloaded shards."""
        for owner, name, index in self.bindings:
            param = owner._parameters[name]
            if self.pin_memory and not param._local_tensor.is_pinned():
                # As FSDP2: shards materialized on the device (to_empty(device="cuda"))
                # go back to host memory.
                param._local_tensor = pinned(param._local_tensor.cpu())
            self.sharded_params[index] = param
        self._adopt_dtypes()
        _ = self.extensions  # malformed hooks of the new local tensors raise now
        self._materialized = False

    def _adopt_dtypes(self) -> None:
        """After ``module.to(dtype)``: each parameter's shard layout (and the bucket's)
        in its new dtype, the policy's dtypes kept, as FSDP2 reads its parameters' dtype
        again at the next all-gather."""
        changed = False
        for index, (param, info) in enumerate(zip(self.sharded_params, self.infos)):
            if param.dtype != info.orig_dtype:
                self.infos[index] = shard_info_in_dtype(
                    self.fqns[index], info.global_size, info.world_size, info.rank,
                    param.dtype, param.requires_grad, self.mp_policy,
                    shard_dim=info.shard_dim, offload_to_cpu=info.offload_to_cpu)
                changed = True
        if changed:
            self.layout = BucketLayout.of(self.infos)

    # -- what an all-gather reads ----------------------------------------------------------

    def local_versions(self) -> Versions:
        """The parameters' versions now: an all-gather issued earlier is still good if
        they are unchanged. In-place ops on the DTensor (optimizer steps,
        load_state_dict) bump only the parameter's version, not its local tensor's;
        writes to the local tensor the reverse."""
        return [(p._version, p._local_tensor._version) for p in self.sharded_params]

    def on_device(self, sharded_locals: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU offload: the host-to-device copy of the shards before their all-gather."""
        if not self.offload_to_cpu or self.device.type == "cpu":
            return sharded_locals
        return [t.to(self.device, non_blocking=True) for t in sharded_locals]

    def check_materialized(self) -> None:
        """Raises FSDP2's error if a parameter is still on meta: before the group's first
        all-gather (forward, ``unshard()`` or a prefetch), outside its autograd bridge.

        Eagerly the answer is kept until the parameters change. A traced forward does
        not check: reading the flag there would add a guard (and writing it, a
        recompile), and reading the parameters through the group lets ``dynamic=True``
        make their shapes symbolic."""
        if torch.compiler.is_compiling():
            return
        if not self._materialized:
            self._raise_if_on_meta()
            self._materialized = True

    def _raise_if_on_meta(self) -> None:
        on_meta = [fqn for fqn, p in zip(self.fqns, self.sharded_params) if p.is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\nFor example, call "
                "module.to_empty(device) to materialize to device and call "
                "module.reset_parameters() on each module to initialize values."
            )


def _tp_layout(fqn: str, param: nn.Parameter, mesh: DeviceMesh,
               spmd: tuple[DeviceMesh, object] | None, shard_dim: int,
               partial_reshard: int | None) -> TensorParallelLayout | None:
    """A TP parameter's layout, checked (see [Note: TP parameters]); None for others."""
    if not isinstance(param, DTensor) and spmd is None:
        return None
    if partial_reshard is not None:
        raise NotImplementedError(
            f"reshard_after_forward={partial_reshard} with tensor-parallel parameter "
            f"{fqn!r}: resharding DTensor parameters to a smaller mesh after forward is "
            "not supported (nor by FSDP2); use reshard_after_forward=True or False"
        )
    if spmd is not None:
        return spmd_layout(fqn, param, *spmd, shard_dim)
    return tensor_parallel_layout(fqn, param, mesh, shard_dim)
