"""What one ``fully_shard`` call's parameter group is: its sharded parameters, where it
communicates, and its settings. No runtime state: that, and the life cycle that changes
it, is :class:`~.param_group.ParamGroup`'s, a subclass of :class:`ShardedGroup`.

[Note: group settings]
A group's settings are plain public attributes, read on every step (so a compiled
graph guards on them and recompiles once when one changes). They are set at
``fully_shard`` time and afterwards only through :meth:`ShardedGroup.configure`, which
``FSDPModule``'s setters call; every other field of a group is private to its class.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_device_from_mesh
from torch.distributed.tensor import DTensor

from ..collectives import ShardInfo, comm
from ..collectives.validation import check_bucket_bytes
from . import block_backward
from .all_gather_extensions import AllGatherExtension, detect_extension
from .arguments import shard_placement
from .post_forward_mesh import PostForwardMesh
from .sharded_params import shard_info, sharded_param
from .tensor_parallel import TensorParallelLayout, spmd_layout, tensor_parallel_layout

if TYPE_CHECKING:  # FSDP2's comm interfaces, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# The settings :meth:`ShardedGroup.configure` may change (see [Note: group settings]).
SETTINGS = frozenset({
    "reshard_after_forward", "reshard_after_backward", "requires_gradient_sync",
    "requires_all_reduce", "gradient_divide_factor", "force_sum_reduction",
    "reduce_scatter_unused_params", "all_reduce_hook", "all_reduce_hook_stream",
    "unshard_in_backward", "all_gather_comm", "reduce_scatter_comm",
    "explicit_forward_prefetch", "explicit_backward_prefetch", "prefetch_backward", "streams",
})


class ShardedGroup:
    """The sharded parameters of one ``fully_shard``-ed module, its mesh and settings.

    Plain data read on every step (infos, process groups, settings) and the modules
    that hold the parameters.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        *,
        modules: list[nn.Module],
        reshard_after_forward: bool | int | None,
        mp_policy: MixedPrecisionPolicy,
        shard_placement_fn: Callable[[nn.Parameter], object] | None,
        offload_to_cpu: bool = False,
        pin_memory: bool = False,
        spmd: tuple[DeviceMesh, object] | None = None,
    ) -> None:
        # What profiler labels and debug logs call the group: its module's path under
        # the root (set when the root links the groups; "" for the root).
        self.name = ""
        # Where the group communicates; with dp_mesh_dims, ``spmd`` is the full mesh the
        # parameters are DTensors on and the DataParallelMeshDims naming ``mesh``'s dims.
        self.mesh = mesh
        self.spmd = spmd
        self.device_type = mesh.device_type
        self.is_hsdp = mesh.ndim == 2
        self.shard_group = mesh.get_group(mesh.ndim - 1)
        block_backward.register(self)
        self.replicate_group = mesh.get_group(0) if self.is_hsdp else None
        self.streams = comm.DeviceStreams(torch.device(mesh.device_type))
        self.device = _get_device_from_mesh(mesh)
        # CPUOffloadPolicy: sharded parameters and gradients live on CPU; the shards
        # are copied to the device before each all-gather.
        self.offload_to_cpu = offload_to_cpu
        self.pin_memory = pin_memory

        # Settings (see [Note: group settings]).
        self.mp_policy = mp_policy
        # None: FSDP2's default, True except for the root group. An int N (between 1
        # and the shard size) reshards to groups of N ranks after forward.
        self._reshard_after_forward: bool | None = None
        self.post_forward_mesh: PostForwardMesh | None = None
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        # Gradient reduction and prefetch settings (see FSDPModule's setters).
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        self.unshard_in_backward = True
        self.all_gather_comm: AllGather | None = None
        self.reduce_scatter_comm: ReduceScatter | None = None
        self.explicit_forward_prefetch = False
        self.explicit_backward_prefetch = False
        # What this group's backward prefetches (set when the root links the groups,
        # or by set_modules_to_backward_prefetch).
        self.prefetch_backward: Callable[[], None] | None = None
        # The root group (set when the root links the groups) reshards after forward
        # only when told to.
        self.is_root = False

        # The parameters: one ShardInfo and one sharded DTensor parameter each; TP
        # parameters also a layout (see [Note: TP parameters]).
        self.fqns = [fqn for fqn, _ in named_params]
        self.infos: list[ShardInfo] = []
        self.tp_layouts: list[TensorParallelLayout | None] = []
        for fqn, param in named_params:
            shard_dim = shard_placement(fqn, param, mesh, shard_placement_fn)
            self.tp_layouts.append(self._tp_layout(fqn, param, shard_dim))
            self.infos.append(shard_info(fqn, param, mesh, mp_policy, shard_dim, offload_to_cpu))
        check_bucket_bytes(self.infos, self.fqns)
        self.sharded_params: list[nn.Parameter] = [
            sharded_param(param, info, mesh, self.is_hsdp, self._shard_device(param),
                          pin_memory, layout)
            for (_, param), info, layout in zip(named_params, self.infos, self.tp_layouts)
        ]
        self._has_tp_params = any(layout is not None for layout in self.tp_layouts)
        # (module, attribute name, parameter index) for every module attribute that
        # holds one of the parameters (a tied weight has several).
        self.bindings: list[tuple[nn.Module, str, int]] = []
        # Per parameter: the first module holding it (FSDP2 passes it to the pre hook).
        self.first_holders: list[nn.Module | None] = [None] * len(self.sharded_params)
        _ = self.extensions  # malformed hooks raise now, at fully_shard, as in FSDP2
        # The modules of the group (several for fully_shard([a, b])).
        self.modules: list[nn.Module] = list(modules)

    @property
    def reshard_after_forward(self) -> bool:
        """Whether backward re-gathers the parameters (by default, all but the root group)."""
        if self._reshard_after_forward is None:
            return not self.is_root
        return self._reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool | int | None) -> None:
        if isinstance(value, bool) or value is None:
            self._reshard_after_forward, self.post_forward_mesh = value, None
        else:
            self._reshard_after_forward = True
            self.post_forward_mesh = PostForwardMesh(self.mesh, value)

    def configure(self, **settings: object) -> None:
        """Sets the group's settings (see [Note: group settings]).

        Args:
            settings: setting name -> new value, e.g. ``reshard_after_backward=False``.

        Raises:
            AttributeError: a name that is not a setting.
        """
        for name, value in settings.items():
            if name not in SETTINGS:
                raise AttributeError(f"{name!r} is not a setting of a parameter group")
            setattr(self, name, value)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The group's next all-gather copy-in waits on ``event`` (used once)."""
        self.streams.set_post_optim_event(event)

    def _tp_layout(self, fqn: str, param: nn.Parameter, shard_dim: int
                   ) -> TensorParallelLayout | None:
        """A TP parameter's layout, checked (see [Note: TP parameters]); None for others."""
        if not isinstance(param, DTensor) and self.spmd is None:
            return None
        if self.post_forward_mesh is not None:
            raise NotImplementedError(
                f"reshard_after_forward={self.post_forward_mesh.group_size} with tensor-parallel "
                f"parameter {fqn!r}: resharding DTensor parameters to a smaller mesh after "
                "forward is not supported (nor by FSDP2); use reshard_after_forward=True "
                "or False"
            )
        if self.spmd is not None:
            return spmd_layout(fqn, param, *self.spmd, shard_dim)
        return tensor_parallel_layout(fqn, param, self.mesh, shard_dim)

    def _shard_device(self, param: nn.Parameter) -> torch.device:
        """Where a sharded parameter lives: meta stays meta (FSDP2 materializes later)."""
        if param.device.type == "meta":
            return param.device
        return torch.device("cpu") if self.offload_to_cpu else self.device

    @property
    def extensions(self) -> list[AllGatherExtension | None]:
        """Per parameter: its all-gather hooks, as its local tensor has them now (looked
        up at every all-gather, as FSDP2 does: hooks may be set after ``fully_shard``)."""
        return [
            detect_extension(fqn, param._local_tensor, info, self.mesh, self.mp_policy, holder)
            for fqn, param, info, holder in zip(
                self.fqns, self.sharded_params, self.infos, self.first_holders)
        ]

    def compute_params(self, unsharded: list[torch.Tensor] | tuple[torch.Tensor, ...]
                       ) -> list[torch.Tensor] | tuple[torch.Tensor, ...]:
        """What forward computes with, from the all-gathered parameters: TP parameters
        as DTensors on their TP mesh (see [Note: TP parameters]), the others as they are."""
        if not self._has_tp_params:
            return unsharded
        return [t if layout is None else layout.unsharded(t)
                for t, layout in zip(unsharded, self.tp_layouts)]

    def add_holder(self, owner: nn.Module, name: str, index: int) -> None:
        """Records that ``owner.<name>`` is parameter ``index`` of this group."""
        self.bindings.append((owner, name, index))
        if self.first_holders[index] is None:
            self.first_holders[index] = owner
        # For a replacement of the attribute (see [Note: replaced parameters]).
        owner.__dict__.setdefault("_fsdp_holders", {})[name] = self

    def _on_device(self, sharded_locals: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU offload: the host-to-device copy of the shards before their all-gather."""
        if not self.offload_to_cpu or self.device.type == "cpu":
            return sharded_locals
        return [t.to(self.device, non_blocking=True) for t in sharded_locals]

    def _local_versions(self) -> list[tuple[int, int]]:
        # In-place ops on the DTensor (optimizer steps, load_state_dict) bump only the
        # parameter's version, not its local tensor's; writes to the local tensor the reverse.
        return [(p._version, p._local_tensor._version) for p in self.sharded_params]
