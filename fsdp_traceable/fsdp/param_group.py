"""One ``fully_shard`` call's parameters: sharding, unsharding and the state around them
(gradient reduction is in :mod:`.gradient_reduction`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp._fully_shard._fsdp_init import _get_device_from_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..collectives import (
    ShardInfo,
    comm,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    make_shard_info,
    shard_tensor,
)
from ..collectives.validation import check_bucket_bytes
from ..profiler_labels import phase
from . import block_backward
from .all_gather_extensions import (
    AllGatherExtension,
    PendingUnshard,
    all_gather_inputs,
    detect_extension,
    unsharded_from_outputs,
)
from .arguments import shard_placement
from .eager_state import EagerState
from .post_forward import PostForwardResharding
from .root_state import RootState
from .tensor_parallel import TensorParallelLayout, spmd_layout, tensor_parallel_layout

if TYPE_CHECKING:  # FSDP2's comm interfaces, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

log = logging.getLogger(__name__)


class ParamGroup:
    """The sharded parameters of one ``fully_shard``-ed module and their collectives.

    Plain data read on every step (infos, process groups, flags), the modules that
    hold the parameters, and, in eager mode only, an :class:`EagerState`. The module
    API changes it only through its methods.
    """

    def __init__(
        self,
        named_params: list[tuple[str, nn.Parameter]],
        mesh: DeviceMesh,
        *,
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

        # Policy: set at fully_shard time, changed by FSDPModule's setters.
        self.mp_policy = mp_policy
        # None: FSDP2's default, True except for the root group. An int N (between 1
        # and the shard size) reshards to groups of N ranks after forward.
        self._reshard_after_forward: bool | None = None
        self.post_forward: PostForwardResharding | None = None
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
        # The root group (set by link_groups) reshards after forward only when told to.
        self.is_root = False
        # What the model shares between its groups (see [Note: per-model state]); the
        # group is its own model until the root's fully_shard links it.
        self.root_state = RootState()

        # The parameters: one ShardInfo and one sharded DTensor parameter each; TP
        # parameters also a layout (see [Note: TP parameters]).
        self.fqns = [fqn for fqn, _ in named_params]
        self.infos: list[ShardInfo] = []
        self.tp_layouts: list[TensorParallelLayout | None] = []
        for fqn, param in named_params:
            shard_dim = shard_placement(fqn, param, mesh, shard_placement_fn)
            self.tp_layouts.append(self._tp_layout(fqn, param, shard_dim))
            self.infos.append(_shard_info(fqn, param, mesh, mp_policy, shard_dim, offload_to_cpu))
        check_bucket_bytes(self.infos, self.fqns)
        self.sharded_params: list[nn.Parameter] = [
            _sharded_param(param, info, mesh, self.is_hsdp, self._shard_device(param),
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
        # Unsharded parameters gathered by FSDPModule.unshard(), used (and released)
        # by the group's next forward, or dropped by reshard().
        self.explicit_unsharded: tuple[torch.Tensor, ...] | None = None
        # The modules of the group (several for fully_shard([a, b])); for those, the
        # unsharded parameters shared by the modules' forwards, and the modules whose
        # forward has not run yet in this pass.
        self.modules: list[nn.Module] = []
        self.shared_unsharded: tuple[torch.Tensor, ...] | None = None
        self.modules_to_run: set[int] = set()
        # On the root group: the fully_shard([a, b]) groups below it, whose forward
        # pass ends with the root's forward at the latest.
        self.list_groups: list[ParamGroup] = []

        # Eager-only state between calls (prefetch, parameters kept for backward,
        # no-sync gradient accumulation) and the group backward prefetches.
        self.eager = EagerState()
        self.prefetch_backward: Callable[[], None] | None = None

    @property
    def reshard_after_forward(self) -> bool:
        """Whether backward re-gathers the parameters (by default, all but the root group)."""
        if self._reshard_after_forward is None:
            return not self.is_root
        return self._reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool | int | None) -> None:
        if isinstance(value, bool) or value is None:
            self._reshard_after_forward, self.post_forward = value, None
        else:
            self._reshard_after_forward = True
            self.post_forward = PostForwardResharding(self.mesh, value)

    def _tp_layout(self, fqn: str, param: nn.Parameter, shard_dim: int
                   ) -> TensorParallelLayout | None:
        """A TP parameter's layout, checked (see [Note: TP parameters]); None for others."""
        if not isinstance(param, DTensor) and self.spmd is None:
            return None
        if self.post_forward is not None:
            raise NotImplementedError(
                f"reshard_after_forward={self.post_forward.group_size} with tensor-parallel "
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

    def refresh_params(self) -> None:
        """Re-reads the sharded parameters from their modules (after ``module._apply``,
        e.g. ``to_empty``, may have replaced them) and re-pins offloaded shards."""
        for owner, name, index in self.bindings:
            param = owner._parameters[name]
            if self.pin_memory and not param._local_tensor.is_pinned():
                # As FSDP2: shards materialized on the device (to_empty(device="cuda"))
                # go back to host memory.
                param._local_tensor = _pinned(param._local_tensor.cpu())
            self.sharded_params[index] = param
        _ = self.extensions  # malformed hooks of the new local tensors raise now
        self.eager = EagerState()

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

    def bind(self, owner: nn.Module, name: str, index: int) -> None:
        """Records that ``owner.<name>`` is parameter ``index`` of this group."""
        self.bindings.append((owner, name, index))
        if self.first_holders[index] is None:
            self.first_holders[index] = owner

    def set_root(self, is_root: bool, prefetch_backward: Callable[[], None] | None,
                 root_state: RootState) -> None:
        """Sets whether this is the root group, what its backward prefetches, and the
        model state it shares with the other groups under the root."""
        self.is_root = is_root
        self.root_state = root_state
        if not self.explicit_backward_prefetch:
            self.prefetch_backward = prefetch_backward

    # -- forward -----------------------------------------------------------------

    def start_all_gather(self) -> PendingUnshard:
        """Starts the group's all-gather (eager), from the post-forward piece when one is
        kept; finish it with :meth:`finish_all_gather`."""
        with phase("all_gather", self.name):
            kept, versions = self.eager.take_post_forward()
            if (kept is not None and self.post_forward is not None
                    and versions == self._local_versions()):
                return self.post_forward.regather(kept, self.all_gather_comm)
            return self._start_all_gather(
                [p._local_tensor for p in self.sharded_params], streams=self.streams
            )

    def _start_all_gather(
        self, sharded_locals: list[torch.Tensor], streams: comm.DeviceStreams | None
    ) -> PendingUnshard:
        sharded_locals = self._on_device(sharded_locals)
        # Traced too: Dynamo guards on the hooks it finds, so hooks set later recompile.
        extensions = self.extensions
        if all(extension is None for extension in extensions):
            result = foreach_all_gather(sharded_locals, self.infos, self.shard_group,
                                        streams=streams, all_gather_comm=self.all_gather_comm,
                                        check=False)
            return PendingUnshard(result, None)
        hook_inputs = all_gather_inputs(sharded_locals, self.infos, extensions)
        result = foreach_all_gather(hook_inputs.tensors, hook_inputs.infos, self.shard_group,
                                    streams=streams, all_gather_comm=self.all_gather_comm)
        return PendingUnshard(result, hook_inputs)

    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]:
        """Waits for the all-gather and returns the unsharded parameters (post hooks run)."""
        with phase("all_gather_copy_out", self.name):
            outputs = foreach_all_gather_copy_out(pending.result)
            if pending.hook_inputs is None:
                return outputs
            return unsharded_from_outputs(outputs, pending.hook_inputs)

    def _on_device(self, sharded_locals: list[torch.Tensor]) -> list[torch.Tensor]:
        """CPU offload: the host-to-device copy of the shards before their all-gather."""
        if not self.offload_to_cpu or self.device.type == "cpu":
            return sharded_locals
        return [t.to(self.device, non_blocking=True) for t in sharded_locals]

    def prefetch(self) -> None:
        """Eager: issues this group's all-gather now, to overlap the compute before it."""
        if not self.sharded_params or self.compiled_on_its_own():
            return
        if self.eager.prefetched is None and self.eager.unsharded_for_backward is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefetch: all-gather of group %r issued early", self.name)
            self.eager.prefetch(self.start_all_gather(), self._local_versions())

    def compiled_on_its_own(self) -> bool:
        """Whether a module of the group was compiled by itself (``module.compile()``, as
        per-block compile does): its graph gathers the parameters, so an eager prefetch
        from the module before it would never be used."""
        return any(getattr(m, "_compiled_call_impl", None) is not None for m in self.modules)

    def _take_prefetched(self) -> PendingUnshard | None:
        """The prefetched all-gather, unless a parameter changed since it was issued."""
        pending, versions = self.eager.take_prefetched()
        if pending is not None and versions != self._local_versions():
            foreach_all_gather_copy_out(pending.result)  # complete the collective every rank joined
            pending = None
        return pending

    def _local_versions(self) -> list[tuple[int, int]]:
        # In-place ops on the DTensor (optimizer steps, load_state_dict) bump only the
        # parameter's version, not its local tensor's; writes to the local tensor the reverse.
        return [(p._version, p._local_tensor._version) for p in self.sharded_params]

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The unsharded parameters (``param_dtype``), from a prefetch when one is in flight."""
        if comm.use_traced_path():
            return self.finish_all_gather(self._start_all_gather(list(sharded_locals), None))
        if self.eager.unsharded_for_backward is not None:
            # Kept by a backward with reshard_after_backward=False: like FSDP2, the
            # next forward uses them whatever the flag says now.
            return self.eager.unsharded_for_backward
        if self.eager.forward_unsharded is not None:
            if self.eager.forward_unsharded_versions == self._local_versions():
                # Gathered by an earlier forward of this group, which does not reshard
                # after forward, and not resharded by a backward since: like FSDP2,
                # still unsharded.
                return [t.detach() for t in self.eager.forward_unsharded]
            self.eager.forward_unsharded = None
        pending = self._take_prefetched()
        if pending is None:
            pending = self.start_all_gather()
        unsharded = self.finish_all_gather(pending)
        if self.post_forward is not None:
            # FSDP2 keeps this piece from the forward's end until the next all-gather;
            # it is taken now, while the all-gather output is alive.
            self.eager.keep_post_forward(self.post_forward.keep(pending), self._local_versions())
        return unsharded

    @property
    def has_trainable_params(self) -> bool:
        """Whether a backward can reach this group's gradient reduction."""
        return any(p.requires_grad for p in self.sharded_params)

    def keep_forward_unsharded(self, unsharded: list[torch.Tensor] | tuple[torch.Tensor, ...]
                               ) -> None:
        """Eager: keeps what a forward that does not reshard gathered, until a backward
        (or :meth:`drop_unsharded`) reshards it (see ``EagerState.forward_unsharded``).

        Kept detached, and handed out as fresh aliases: a kept tensor that carried its
        autograd node would tie the group to that node's context (which holds the
        group), a cycle through autograd that Python's collector cannot free when no
        backward comes.
        """
        self.eager.forward_unsharded = tuple(t.detach() for t in unsharded)
        self.eager.forward_unsharded_versions = self._local_versions()

    # -- backward ----------------------------------------------------------------

    def unsharded_for_backward(self) -> list[torch.Tensor]:
        """Eager: the parameters re-gathered once for this group's backward."""
        if self.eager.unsharded_for_backward is None:
            with phase("pre_backward", self.name):
                self._unshard_for_backward()
        return self.eager.unsharded_for_backward

    def _unshard_for_backward(self) -> None:
        """Eager: re-gathers the parameters for backward, then prefetches per the group's order."""
        if not self.unshard_in_backward:
            raise RuntimeError(
                f"the backward of the group of {self.fqns[:3]} reads its parameters, but "
                "set_unshard_in_backward(False) was called on its module: set it back "
                "to True (False is only for modules whose backward needs no parameters)"
            )
        pending = self._take_prefetched()
        if pending is None:
            pending = self.start_all_gather()
        self.eager.unsharded_for_backward = self.finish_all_gather(pending)
        if torch._C._current_graph_task_id() != -1:
            # Also frees them for a group without trainable parameters, whose
            # backward never reaches reduce_grads.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # Prefetch only once this group's all-gather buffer is freed: the peak then
        # holds one in-flight buffer, not two.
        if self.prefetch_backward is not None:
            self.prefetch_backward()

    def drop_unsharded(self) -> None:
        """Eager: frees a prefetched all-gather and parameters kept after backward."""
        with phase("reshard", self.name):
            pending, _ = self.eager.take_prefetched()
            if pending is not None:
                # Complete the collective every rank joined.
                foreach_all_gather_copy_out(pending.result)
            self.eager.unsharded_for_backward = None
            self.eager.forward_unsharded = None
            self.eager.take_post_forward()

    def _end_backward(self) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group %r after backward: %s", self.name,
                      "reshard" if self.reshard_after_backward
                      else "keep the unsharded parameters for the next forward")
        if self.reshard_after_backward:
            with phase("reshard", self.name):
                self.eager.unsharded_for_backward = None


def _shard_info(
    fqn: str,
    param: nn.Parameter,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    shard_dim: int,
    offload_to_cpu: bool,
) -> ShardInfo:
    # A TP parameter's FSDP shards are of its local tensor (see [Note: TP parameters]).
    shape = param._local_tensor.shape if isinstance(param, DTensor) else param.shape
    try:
        return make_shard_info(
            shape, mesh.size(mesh.ndim - 1), mesh.get_local_rank(mesh.ndim - 1),
            shard_dim=shard_dim, orig_dtype=param.dtype, param_dtype=mp_policy.param_dtype,
            reduce_dtype=mp_policy.reduce_dtype, offload_to_cpu=offload_to_cpu,
        )
    except (TypeError, ValueError) as err:
        raise type(err)(f"parameter {fqn!r}: {err}") from None


def _sharded_param(
    param: nn.Parameter,
    info: ShardInfo,
    mesh: DeviceMesh,
    is_hsdp: bool,
    device: torch.device,
    pin_memory: bool,
    tp_layout: TensorParallelLayout | None,
) -> nn.Parameter:
    data = param._local_tensor if isinstance(param, DTensor) else param
    local = shard_tensor(data.detach().to(device), info)
    if pin_memory and device.type == "cpu":
        local = _pinned(local)
    if tp_layout is not None:
        mesh, placements = tp_layout.spmd_mesh, tp_layout.spmd_placements
    else:
        shard = Shard(info.shard_dim)
        placements = (Replicate(), shard) if is_hsdp else (shard,)
    dtensor = DTensor.from_local(
        local, mesh, placements, run_check=False, shape=param.shape, stride=param.stride(),
    )
    return nn.Parameter(dtensor, requires_grad=param.requires_grad)


def _pinned(local: torch.Tensor) -> torch.Tensor:
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
