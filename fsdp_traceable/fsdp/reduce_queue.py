"""Eager gradient reductions in flight, finished in order.

A group's backward starts its reduce-scatter and returns; the reduction is finished
here (waited, all-reduced for HSDP, unpacked into ``.grad``) when the next group starts
its own, so one reduce-scatter overlaps the next group's gradient computation, and
at the latest when the backward pass ends. FSDP2 keeps one in flight the same way.

One queue per model (:class:`~fsdp_traceable.fsdp.root_state.RootState`): a model's
reductions never wait behind another's, and what a model leaves in flight goes with it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn as nn

from ..collectives import accumulate_sharded_grad, comm
from ..collectives.reduce import PendingReduce, finish_foreach_reduce
from ..profiler_labels import phase
from . import post_accumulate_hooks


class GradientTarget(NamedTuple):
    """Where a finished reduction's gradients go: the ``.grad`` of ``params[i]`` for
    each ``i`` in ``indices`` (the group's own list, so parameters a module re-created
    since are the ones written), or, while HSDP skips the all-reduce,
    ``keep_partial_reduce_output`` (the group keeps it for the next backward)."""

    params: list[nn.Parameter]
    indices: list[int]
    keep_partial_reduce_output: Callable[[torch.Tensor | None], None]


class ReduceQueue:
    """One model's started reductions, oldest first, with the backward pass whose end
    finishes them."""

    def __init__(self) -> None:
        self._in_flight: list[tuple[PendingReduce, GradientTarget]] = []
        # The backward pass whose end finishes _in_flight (autograd's graph task id).
        self._flushing_task = -1
        # False in manual backward finalization: finalize_backward finishes them (see
        # [Note: backward finalization]).
        self.finish_at_backward_end = True

    def __len__(self) -> int:
        return len(self._in_flight)

    def put(self, pending: PendingReduce, target: GradientTarget) -> None:
        """Adds a started reduction, then finishes every earlier one.

        Args:
            pending: the started reduction.
            target: where its gradients go once it is finished.
        """
        task = torch._C._current_graph_task_id()
        if task == -1:
            # Outside a backward pass (FullyShardState's post_backward, called by a
            # pipeline stage): no end of backward finishes it; the stage's final
            # callback (finish_all) does.
            self._flushing_task = -1
        elif task != self._flushing_task:
            # A new backward pass. Reductions left by one of this model's that raised
            # before its end are finished first: every rank started them.
            if self.finish_at_backward_end:
                self.finish_all()
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_all)
            self._flushing_task = task
        self._in_flight.append((pending, target))
        while len(self._in_flight) > 1:
            self._finish_oldest()

    def finish_all(self) -> None:
        """Finishes every reduction in flight (the end-of-backward callback)."""
        with phase("root_post_backward"):
            while self._in_flight:
                self._finish_oldest()

    def discard_all(self) -> None:
        """Waits for every reduction in flight and drops it, writing no ``.grad``
        (``reset_iter_state``: the failed iteration's gradients are lost, as FSDP2's)."""
        in_flight, self._in_flight = self._in_flight, []
        for pending, _ in in_flight:
            comm.wait(pending.reduce_output)
        self._flushing_task = -1

    def _finish_oldest(self) -> None:
        """Finishes the oldest reduction and writes its gradients into ``.grad``."""
        pending, target = self._in_flight.pop(0)
        result = finish_foreach_reduce(pending)
        if result.sharded_grads is None:
            target.keep_partial_reduce_output(result.partial_reduce_output)
            return
        for i, grad in zip(target.indices, result.sharded_grads):
            param = target.params[i]
            # A zero-size parameter gets no gradient, as through autograd (see unshard_params).
            if param.numel():
                # Run below: see [Note: post-accumulate-grad hooks in eager backward].
                post_accumulate_hooks.restore(param)
                accumulate_sharded_grad(param, grad)
