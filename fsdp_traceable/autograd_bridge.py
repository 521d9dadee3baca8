"""The autograd boundary of a parameter group: all-gather forward, reduce-scatter backward."""

from __future__ import annotations

import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .param_group import ParamGroup


class UnshardParams(torch.autograd.Function):
    """Forward: copy-in, all-gather, copy-out. Backward: reduce-scatter into sharded grads.

    Inputs are the group's sharded local tensors; outputs the unsharded parameters.
    Autograd accumulates the returned sharded gradients into the sharded DTensor
    parameters' ``.grad`` (through ``DTensor.to_local``'s backward).
    """

    @staticmethod
    def forward(ctx, group: ParamGroup, *sharded_locals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)  # an unused parameter's gradient stays None
        unsharded = group.all_gather(sharded_locals)
        frozen = [t for t, p in zip(unsharded, group.sharded_params) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(unsharded)

    @staticmethod
    def backward(ctx, *unsharded_grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (None, *ctx.group.reduce_grads(unsharded_grads))


def _recompute_all_gather_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


def _recompute_all_gather_context():
    return create_selective_checkpoint_contexts(_recompute_all_gather_policy)


def _apply_unshard(group: ParamGroup, *sharded_locals: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return UnshardParams.apply(group, *sharded_locals)


def unshard_params(group: ParamGroup, *, recompute_in_backward: bool) -> tuple[torch.Tensor, ...]:
    """The group's unsharded parameters, connected to autograd.

    With ``recompute_in_backward`` (compiled reshard-after-forward), the all-gather
    runs under a selective-checkpoint policy that marks every op must-recompute, so
    the partitioner saves the sharded inputs and re-runs the all-gather in backward
    instead of saving the unsharded parameters.
    """
    sharded_locals = [p.to_local() for p in group.sharded_params]
    if recompute_in_backward:
        return checkpoint(
            _apply_unshard, group, *sharded_locals,
            use_reentrant=False, context_fn=_recompute_all_gather_context,
        )
    return _apply_unshard(group, *sharded_locals)
