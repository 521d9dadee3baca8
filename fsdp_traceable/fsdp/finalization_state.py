"""One model's backward-finalization mode and iteration, kept on its ``RootState``
(see [Note: backward finalization] in ``backward_finalization``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..tracing import in_backward

if TYPE_CHECKING:
    from .reduce_queue import ReduceQueue


class BackwardFinalization:
    """One model's backward-finalization mode and iteration (on its ``RootState``)."""

    def __init__(self, reduce_queue: ReduceQueue) -> None:
        self._reduce_queue = reduce_queue
        # set_manual_backward_finalization's value, and the mode the current backward
        # iteration started with (None: no backward since the last finalization).
        self.manual = False
        self.active: bool | None = None
        # The autograd graph task that latched ``active``, and whether an eager
        # forward ran at all (finalizing before the first one is a no-op, as FSDP2).
        self._task = -1
        self.forward_ran = False
        # An async finalization not yet waited for, and the handle generation a
        # reset invalidates.
        self.pending = False
        self.generation = 0

    def set_manual(self, enabled: bool) -> None:
        """``set_manual_backward_finalization`` on the root, with FSDP2's checks."""
        if enabled != self.manual and in_backward():
            raise RuntimeError("set_manual_backward_finalization cannot change mode during backward")
        if self.active is not None and enabled != self.active:
            raise RuntimeError(
                "set_manual_backward_finalization cannot change mode after backward starts")
        self.manual = enabled
        self._reduce_queue.finish_at_backward_end = not enabled

    def before_forward(self) -> None:
        """An eager forward of the model starts: no async finalization may be pending."""
        if self.pending:
            raise RuntimeError("The previous gradient reduction must be waited on before forward")
        self.forward_ran = True

    def note_backward(self) -> None:
        """A group's eager backward ran: latch the mode for this backward iteration (an
        automatic one ends with the backward pass)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task == self._task:
            return
        self._task = task
        if self.active is None:
            self.active = self.manual
        if not self.active:
            torch.autograd.Variable._execution_engine.queue_callback(self._end_automatic)

    def _end_automatic(self) -> None:
        if self.active is False:
            self.active = None

    def end_iteration(self) -> None:
        """The iteration is finalized (or reset): the mode may change again."""
        self.active = None
        self._task = -1
        self.pending = False

    def reset(self) -> None:
        """Forgets the iteration and invalidates an outstanding handle."""
        self.end_iteration()
        self.generation += 1
