"""Eager gradient reductions in flight, finished in order.

A group's backward starts its reduce-scatter and returns; the reduction is finished
(waited, all-reduced for HSDP, unpacked into ``.grad``) when the next group starts
its own, so one reduce-scatter overlaps the next group's gradient computation, and
at the latest when the backward pass ends. FSDP2 keeps one in flight the same way.

One queue per model (:class:`~fsdp_traceable.fsdp.root_state.RootState`): a model's
reductions never wait behind another's, and what a model leaves in flight goes with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..collectives import ReduceResult
from ..collectives.reduce import PendingReduce, finish_foreach_reduce
from ..profiler_labels import phase


class ReduceQueue:
    """One model's started reductions, oldest first, with the backward pass whose end
    finishes them."""

    def __init__(self) -> None:
        self._in_flight: list[tuple[PendingReduce, Callable[[ReduceResult], None]]] = []
        # The backward pass whose end finishes _in_flight (autograd's graph task id).
        self._flushing_task = -1

    def __len__(self) -> int:
        return len(self._in_flight)

    def put(self, pending: PendingReduce, on_finished: Callable[[ReduceResult], None]) -> None:
        """Adds a started reduction, then finishes every earlier one.

        Args:
            pending: the started reduction.
            on_finished: called with its result once it is finished.
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
            self.finish_all()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_all)
            self._flushing_task = task
        self._in_flight.append((pending, on_finished))
        while len(self._in_flight) > 1:
            self._finish_oldest()

    def finish_all(self) -> None:
        """Finishes every reduction in flight (the end-of-backward callback)."""
        with phase("root_post_backward"):
            while self._in_flight:
                self._finish_oldest()

    def _finish_oldest(self) -> None:
        pending, on_finished = self._in_flight.pop(0)
        on_finished(finish_foreach_reduce(pending))
