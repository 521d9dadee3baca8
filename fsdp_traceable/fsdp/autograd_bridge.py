"""The autograd boundary of a parameter group: all-gather forward, reduce-scatter backward."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .. import _torch_patches
from ..collectives import comm
from .functorch_transforms import outside_functorch_transforms
from .gradient_reduction import declare_grad_dtypes

if TYPE_CHECKING:
    from .group_settings import GroupSettings
    from .param_shards import ParamShards


def patch_torch() -> None:
    """See [Note: torch patches]: the sharded gradients a compiled backward returns are
    wrapped back into DTensors in a frame Dynamo must not compile on its own, the
    recompute region below makes torch log a warning that does not apply to it, and
    Dynamo need not compare the all-gather's outputs with its inputs. Applied by every
    ``fully_shard`` call (again: no change), never on import."""
    _torch_patches.skip_dtensor_unflatten_frames()
    _torch_patches.drop_context_fn_warning()
    _torch_patches.shard_uneven_new_empty_strided()
    _torch_patches.trust_fresh_outputs()


class UnshardingGroup(Protocol):
    """What the autograd boundary calls of its parameter group (``ParamGroup``): the
    group's own life cycle runs in its forward and backward."""

    params: ParamShards
    settings: GroupSettings

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...],
                   kept_piece: torch.Tensor | None = None) -> list[torch.Tensor]: ...

    def traced_post_forward_piece(self, sharded_locals: list[torch.Tensor]) -> torch.Tensor: ...

    def post_backward(self, unsharded_grads: tuple[torch.Tensor | None, ...],
                      accumulated: dict[int, torch.Tensor] | None) -> list[torch.Tensor | None]: ...

    def hide_post_accumulate_hooks(self) -> None: ...

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None: ...


class _GradLayout(NamedTuple):
    """A sharded parameter's DTensor layout, which its sharded gradient takes: read from
    its spec once at forward, so a backward that Dynamo traces (compiled autograd's,
    once per block under per-block compile) reads fields instead of calling the spec's
    ``shape`` and ``stride`` properties per gradient."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]
    device_type: str

    @classmethod
    def of(cls, spec: DTensorSpec) -> _GradLayout:
        return cls(spec.mesh, spec.placements, spec.shape, spec.stride, spec.mesh.device_type)


def _offloaded_grad(grad: torch.Tensor, layout: _GradLayout) -> DTensor:
    """CPU offload on a GPU mesh: the gradient stays on the host, where from_local would
    move it to the mesh's device; wrapped as to_local's backward does."""
    meta = TensorMeta(layout.shape, layout.stride, grad.dtype)
    return DTensor(grad, DTensorSpec(layout.mesh, layout.placements, tensor_meta=meta),
                   requires_grad=grad.requires_grad)


class UnshardParams(torch.autograd.Function):
    """Forward: copy-in, all-gather, copy-out. Backward: reduce-scatter into sharded grads.

    Inputs are the post-forward piece to re-gather from (traced
    ``reshard_after_forward=N``, else ``None``; see [Note: the post-forward piece,
    compiled]), the group's sharded local tensors (from ``DTensor.to_local``) traced or
    its sharded parameters themselves eager (see [Note: eager inputs are the
    parameters]), then the unsharded gradients that eager no-sync
    microbatches accumulated (by parameter index ``accumulated_indices``), which
    backward adds before reducing; outputs the unsharded parameters. A traced backward
    returns the sharded gradients, which autograd accumulates into the parameters'
    ``.grad`` through those inputs; an eager one returns none and the reduction writes
    ``.grad`` once its reduce-scatter completes (see ``reduce_queue``). Both run the
    group's own life cycle: ``ParamGroup.all_gather`` forward, ``post_backward`` backward.
    """

    @staticmethod
    @_torch_patches.fresh_outputs  # the all-gather's outputs, never an input
    def forward(ctx, group: UnshardingGroup, accumulated_indices: tuple[int, ...],
                kept_piece: torch.Tensor | None, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.accumulated_indices = accumulated_indices
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        sharded = inputs[: len(inputs) - len(accumulated_indices)]
        ctx.save_for_backward(*inputs[len(sharded):])
        # See [Note: eager inputs are the parameters].
        ctx.grad_layouts = [_GradLayout.of(t._spec) if isinstance(t, DTensor) else None
                            for t in sharded]
        sharded_locals = tuple(t._local_tensor if isinstance(t, DTensor) else t for t in sharded)
        unsharded = group.all_gather(sharded_locals, kept_piece)
        declare_grad_dtypes(ctx, group.params, unsharded)
        frozen = [t for t, p in zip(unsharded, group.params.sharded_params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(unsharded)

    @staticmethod
    def backward(ctx, *unsharded_grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        accumulated = dict(zip(ctx.accumulated_indices, ctx.saved_tensors))
        sharded_grads = ctx.group.post_backward(unsharded_grads, accumulated)
        # Eager only: see [Note: post-accumulate-grad hooks in eager backward].
        ctx.group.hide_post_accumulate_hooks()
        sharded_grads = [
            grad if grad is None or layout is None
            else DTensor.from_local(grad, layout.mesh, layout.placements, run_check=False,
                                    shape=layout.shape, stride=layout.stride)
            if grad.device.type == layout.device_type else _offloaded_grad(grad, layout)
            for grad, layout in zip(sharded_grads, ctx.grad_layouts)
        ]
        return (None, None, None, *sharded_grads, *[None] * len(accumulated))


def _recompute_all_gather_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


@_torch_patches.quiet_context_fn  # copy-in, all-gather, copy-out: no in-place op
def _recompute_all_gather_context():
    return create_selective_checkpoint_contexts(_recompute_all_gather_policy)


# What AOTAutograd's cache keys a selective-checkpoint region on; without it every graph
# holding a recomputed all-gather bypasses that cache, and a restarted process compiles
# its graphs again.
_recompute_all_gather_context.cache_hash = "fsdp_traceable.recompute_all_gather.v1"

def _apply_unshard(group: UnshardingGroup, accumulated_indices: tuple[int, ...],
                   kept_piece: torch.Tensor | None, *inputs: torch.Tensor
                   ) -> tuple[torch.Tensor, ...]:
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        # Nothing to differentiate (no_grad, or a frozen group). Not through the
        # Function: Dynamo then traces its forward as a plain call and drops ``ctx``
        # whenever the argument count happens to equal forward's parameter count.
        return tuple(group.all_gather(inputs[: len(inputs) - len(accumulated_indices)],
                                      kept_piece))
    return UnshardParams.apply(group, accumulated_indices, kept_piece, *inputs)


# [Note: Dynamo reaches parameters through their module]
# The traced unshard reads each sharded parameter as ``owner._parameters[name]``, not
# from the group's own list (the same objects): Dynamo recognises a tensor as a
# parameter only when it reaches it through a module. It then keeps its shape static
# (also under torch.compile(dynamic=True), which otherwise makes every dim of every
# sharded parameter symbolic) and passes it as a static graph input, which a tensor
# reached through the group is not. The forward reads the unsharded parameters through
# the module too: each parameter attribute is a property of the swapped-in class
# (unsharded_binding).


# [Note: eager inputs are the parameters]
# An eager forward hands ``UnshardParams`` the sharded parameters themselves (DTensors),
# whose local tensors its forward reads: one autograd node per group. Its backward
# returns each sharded gradient wrapped as the parameter's DTensor
# (``DTensor.from_local`` with the parameter's shape and stride: Dynamo traces that,
# not ``to_local``'s own backward, which calls a C++ stride helper). Only compiled
# autograd sees those gradients (an eager backward returns none: the reduction writes
# ``.grad``), after an eager forward (per-block compile, ``FSDPModule.unshard()``); a
# separate ``to_local`` node per group would add one more captured backward, its
# output check and one graph output per parameter, per block, to compiled autograd's
# graph.


def _eager_inputs(params: list[torch.nn.Parameter], nonempty: tuple[bool, ...]) -> list[torch.Tensor]:
    # A zero-size parameter gets no gradient: its DTensor's own local shape can differ
    # from FSDP2's (e.g. (2, 0) vs (0, 0) for an (8, 0) parameter on 4 ranks), which
    # the gradient's DTensor would then carry; an empty gradient carries nothing anyway.
    if all(nonempty):
        return list(params)
    return [p if keep else p.to_local().detach() for p, keep in zip(params, nonempty)]


def _module_params(params: ParamShards) -> list[torch.nn.Parameter]:
    """The sharded parameters read from their modules' ``_parameters``; see
    [Note: Dynamo reaches parameters through their module]. A module that registers an
    unsharded parameter (no ``nn.Parameter``: kept by an eager forward, see [Note:
    registered parameters]) gives the group's own sharded one."""
    registered = [owner._parameters[name]
                  for owner, name in zip(params.first_holders, params.first_names)]
    return [p if isinstance(p, torch.nn.Parameter) else params.sharded_params[i]
            for i, p in enumerate(registered)]


@outside_functorch_transforms  # see [Note: functorch transforms]
def unshard_params(group: UnshardingGroup, *, recompute_in_backward: bool) -> tuple[torch.Tensor, ...]:
    """The group's unsharded parameters, connected to autograd.

    With ``recompute_in_backward`` (compiled reshard-after-forward), the all-gather
    runs under a selective-checkpoint policy that marks every op must-recompute, so
    the partitioner saves the sharded inputs and re-runs the all-gather in backward
    instead of saving the unsharded parameters.
    """
    if not group.params.infos:  # e.g. a root whose parameters all live in sharded blocks
        return ()
    traced = comm.use_traced_path()
    post_forward_mesh = group.settings.post_forward_mesh
    if (post_forward_mesh is not None and traced
            and any(extension is not None for extension in group.params.extensions)):
        size = post_forward_mesh.group_size
        raise NotImplementedError(
            f"reshard_after_forward={size} with all-gather extensions (fsdp_pre_all_gather) "
            "runs eagerly only: a compiled graph keeps a piece of the all-gather output, "
            "which the extensions' post hook cannot rebuild from. Under torch.compile use "
            "reshard_after_forward=True or False (e.g. set_reshard_after_forward(True))"
        )
    # Not ``sharded_params`` when traced: testing that list makes Dynamo reach its
    # first parameter through it, not through its module (see [Note: Dynamo reaches
    # parameters through their module]).
    params = _module_params(group.params) if traced else group.params.sharded_params
    # A zero-size parameter gets no gradient (see _eager_inputs).
    if traced:
        sharded_locals = [p.to_local() if nonempty else p.to_local().detach()
                          for p, nonempty in zip(params, group.params.nonempty)]
    else:
        sharded_locals = _eager_inputs(params, group.params.nonempty)
    accumulated: dict[int, torch.Tensor] = {}
    if traced and torch.is_grad_enabled():
        # Gradients of eager no-sync microbatches join this compiled backward as inputs:
        # a traced backward may not take them from the group's state (Dynamo refuses
        # mutating Python objects there), the traced forward may.
        accumulated = group.take_accumulated_grads() or {}
    indices = tuple(sorted(accumulated))
    inputs = (*sharded_locals, *(accumulated[i] for i in indices))
    kept_piece = None
    if post_forward_mesh is not None and recompute_in_backward:
        # See [Note: the post-forward piece, compiled]: the region below re-gathers
        # from the piece, so its input, and what backward keeps, is the piece.
        kept_piece = group.traced_post_forward_piece(sharded_locals)
    if recompute_in_backward:
        return checkpoint(
            _apply_unshard, group, indices, kept_piece, *inputs,
            use_reentrant=False, context_fn=_recompute_all_gather_context,
        )
    return _apply_unshard(group, indices, kept_piece, *inputs)
