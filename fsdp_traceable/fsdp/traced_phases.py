"""A parameter group's traced path: the steps of its life cycle that differ while
Dynamo traces it (functional collectives, nothing left in flight between calls).

``ParamGroup`` picks this or :class:`~.eager_phases.EagerPath` once per call (see
[Note: the traced/eager seam]). The graph keeps what eager keeps in Python state:
the all-gather is recomputed in backward (a selective-checkpoint region, see
:func:`~.autograd_bridge.unshard_params`), the sharded gradients are returned through
autograd, and Inductor places the collectives, so nothing is prefetched or queued here.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn as nn

from ..collectives import comm
from ..collectives.reduce import PendingReduce, finish_foreach_reduce
from . import group_all_gather
from .autograd_bridge import UnshardingGroup, unshard_params
from .eager_state import EagerState
from .features.all_gather_extensions import PendingUnshard


class TracedGroup(UnshardingGroup, Protocol):
    """What the traced path reads of its group (``ParamGroup``) besides its parameters
    and settings."""

    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]: ...

    def end_backward(self) -> None: ...


class TracedPath:
    """The traced steps of one group's life cycle (see the module docstring).

    Args:
        group: the group.
        state: its eager state: only a backward that compiled autograd traces after an
            eager forward reads it (the piece that forward kept) and keeps its
            parameters there until the backward ends.
    """

    def __init__(self, group: TracedGroup, state: EagerState) -> None:
        self._group = group
        self._state = state

    def unshard_ahead(self) -> bool:
        """``unshard(async_op=True)``: a graph waits where it uses the all-gather, so
        nothing is issued ahead. Returns False: ``unshard`` waits now."""
        return False

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...],
                   kept_piece: torch.Tensor | None) -> list[torch.Tensor]:
        """``ParamGroup.all_gather``: of ``sharded_locals`` over the shard group, or,
        with ``reshard_after_forward=N``, from the piece of :meth:`post_forward_piece`
        (see [Note: the post-forward piece, compiled])."""
        group = self._group
        settings = group.settings
        if kept_piece is not None:
            return settings.post_forward_mesh.traced_unsharded(kept_piece, group.params.layout)
        pending = group_all_gather.start_all_gather(
            group.params, list(sharded_locals), streams=None,
            all_gather_comm=settings.all_gather_comm)
        return group.finish_all_gather(pending)

    def post_forward_piece(self, sharded_locals: list[torch.Tensor]) -> torch.Tensor:
        """``reshard_after_forward=N``: the all-gather of the local shards across the
        groups of ``N`` ranks, the piece the forward and the backward re-gather from
        (see [Note: the post-forward piece, compiled])."""
        group = self._group
        settings = group.settings
        pending = group_all_gather.start_all_gather(
            group.params, sharded_locals, streams=None, all_gather_comm=settings.all_gather_comm,
            group=settings.post_forward_mesh.across_groups)
        return comm.wait(pending.result.pending)

    # -- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Raises for explicit prefetching, which a graph cannot schedule."""
        settings = self._group.settings
        if settings.explicit_forward_prefetch or settings.explicit_backward_prefetch:
            raise NotImplementedError(
                "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch schedule "
                "eager all-gathers; in a compiled graph Inductor places them "
                "(torch.compile(options=fsdp_traceable.inductor_options(overlap=True))). "
                "Pass [] to both setters before compiling"
            )

    def gather_for_forward(self, reshard: bool) -> tuple[torch.Tensor, ...]:
        """The forward's unsharded parameters; with ``reshard``, backward recomputes
        their all-gather instead of saving them."""
        return unshard_params(self._group, recompute_in_backward=reshard)

    def after_forward_gather(self, module: nn.Module, unsharded: tuple[torch.Tensor, ...]
                             ) -> None:
        """Nothing: Inductor places the next groups' all-gathers."""

    def saved_tensor_hooks(self) -> Any:
        """None: the graph saves what it recomputes (see :meth:`gather_for_forward`)."""
        return None

    def hook_backward_start(self, output: Any) -> None:
        """Nothing: the graph gathers where its backward reads a parameter."""

    def release(self, unsharded: tuple[torch.Tensor, ...], bound: bool) -> None:
        """After the forward: unbinds (the graph frees what it does not save)."""
        if bound:
            self._group.params.unbind()

    # -- backward -------------------------------------------------------------------------

    def gather_for_backward(self) -> None:
        """Compiled autograd traces the unpack hook of an eager forward's token (see
        [Note: per-module compile]): the parameters are gathered again and kept until
        the backward ends. One storage per parameter, as eager's: an outlined block
        backward takes them as inputs, which may not alias."""
        self._state.keep_for_backward(self._regather())
        torch.autograd.Variable._execution_engine.queue_callback(self._group.end_backward)

    def _regather(self) -> list[torch.Tensor]:
        """From the piece the eager forward kept with ``reshard_after_forward=N`` (over
        the rank's ``N`` ranks, as the eager backward), else over the shard group. Each
        parameter in a buffer of its own: the copy-out gives one per parameter in
        compiled autograd's graph (``fresh_outputs_needed`` in
        :mod:`..collectives.ops`), so no copy per parameter is traced for the plain
        bucket; what an all-gather extension's post hook or the kept storage return is
        copied."""
        group = self._group
        kept, _ = self._state.take_piece()
        mesh = group.settings.post_forward_mesh
        if kept is not None and mesh is not None and kept.hook_inputs is None:
            return mesh.traced_regathered(kept)
        # An all-gather extension's post-all-gather hook needs its metadata from a
        # pre-all-gather call of this trace: gathered again over the shard group.
        pending = group_all_gather.start_all_gather(
            group.params, [p._local_tensor for p in group.params.sharded_params],
            streams=None, all_gather_comm=group.settings.all_gather_comm)
        unsharded = group.finish_all_gather(pending)
        if pending.hook_inputs is not None or group.settings.keep_unsharded_storage:
            return [t.clone() for t in unsharded]
        return unsharded

    def begin_post_backward(self) -> None:
        """Nothing: see [Note: a traced backward mutates no Python state]."""

    def finish_reduce(self, pending: PendingReduce, indices: list[int],
                      sharded_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Finishes the reduction and returns the sharded gradients, which autograd
        passes on to the parameters."""
        result = finish_foreach_reduce(pending)
        for i, grad in zip(indices, result.sharded_grads):
            sharded_grads[i] = grad
        return sharded_grads

    def hide_post_accumulate_hooks(self) -> None:
        """Nothing: a traced backward's gradients reach ``.grad`` through autograd,
        which runs the hooks once."""
