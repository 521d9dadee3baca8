"""Who ends a backward iteration: autograd, or the caller (FSDP2's manual backward
finalization, torch 2.15), and how a failed iteration is reset.

[Note: backward finalization]
By default a backward pass ends itself: the model's reductions in flight are finished
(their ``.grad`` written) by an autograd callback at the end of each backward pass, and
each group's parameters kept for backward are freed by its own callback. FSDP2 2.15's
``set_manual_backward_finalization(True)`` on the root hands that end to the caller:

- The mode is read when a backward pass of the model starts and stays until the
  iteration is finalized; changing it during a backward, or after one started and
  before ``finalize_backward``, raises (FSDP2's checks, FSDP2's messages).
- In manual mode the end of a backward pass leaves the reductions in flight;
  ``finalize_backward()`` finishes the iteration: each group, last to first, reduces
  the no-sync gradients it accumulated when gradient sync is on now (else it keeps
  them), or frees its parameters kept for backward when ``reshard_after_backward`` is
  on; then every reduction in flight is finished. ``finalize_backward(async_op=True)``
  starts those reductions and returns a handle whose ``wait()`` finishes them; until
  then a forward, or another finalization, raises.
- HSDP partial reductions (``set_requires_all_reduce(False)``) are not supported in
  manual mode, as FSDP2: a group holding one, or about to start one, raises at
  finalization.
- ``reset_iter_state()`` on the root forgets no-sync and partial HSDP gradients and
  the iteration's mode, and invalidates an outstanding handle. On a torch whose FSDP2
  has manual finalization (2.15 on) it waits for the reductions in flight and discards
  them (every rank started them; no ``.grad`` is written), and clears the sharded
  gradients, as FSDP2's reset does there; before, it finishes them (FSDP2 has written
  their ``.grad`` by then).

torch's pipeline stages (2.15) drive this: ``set_manual_backward_finalization(True)``
before each microbatch's forward, no-sync backwards, then ``set_requires_gradient_sync
(True)``, ``set_reshard_after_backward(True)``, ``finalize_backward(async_op=True)`` and
the handle's ``wait()`` (see [Note: pipeline schedules] for the releases before).

Everything here is eager: a compiled backward returns its sharded gradients through
autograd and leaves nothing in flight, so finalizing after it only frees what eager
code kept; calling ``finalize_backward`` inside a compiled function raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

from ..tracing import in_backward
from .finalization_state import BackwardFinalization

if TYPE_CHECKING:
    from .param_group import ParamGroup
    from .reduce_queue import ReduceQueue

try:  # torch 2.15 on: finalize_backward(async_op=True)'s handle type
    from torch.distributed.fsdp import GradientReductionHandle as _HandleBase
except ImportError:
    _HandleBase = object  # type: ignore[assignment,misc]

# Whether this torch's FSDP2 has manual backward finalization, and with it the reset
# that also clears the sharded gradients of the failed iteration.
TORCH_HAS_MANUAL_FINALIZATION = callable(getattr(TorchFSDPModule, "finalize_backward", None))


def finalize(root_group: ParamGroup, groups: list[ParamGroup], async_op: bool
             ) -> GradientReductionHandle | None:
    """``FSDPModule.finalize_backward`` on the module of ``root_group``.

    Args:
        root_group: the group of the module it was called on.
        groups: every group under that module, in module pre-order.
        async_op: return a handle instead of finishing the reductions here.
    """
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "finalize_backward runs eagerly (it waits for eager gradient reductions); call "
            "it outside the compiled function, after backward"
        )
    state = root_group.root_state
    finalization = state.finalization
    if not finalization.forward_ran:
        return GradientReductionHandle(None, 0) if async_op else None
    if finalization.pending:
        raise RuntimeError(
            "The previous gradient reduction must be waited on before finalizing backward again")
    if not root_group.settings.is_root:
        raise RuntimeError("finalize_backward must be called on the root FSDP module")
    manual = finalization.active if finalization.active is not None else finalization.manual
    if not manual:
        raise RuntimeError(
            "FSDP finalize_backward requires manual backward finalization. Call "
            "set_manual_backward_finalization(True) before forward"
        )
    if in_backward():
        raise RuntimeError("FSDP finalize_backward must be called after backward completes")
    for group in groups:
        if group.has_partial_reduce_output:
            raise RuntimeError(
                "FSDP manual backward finalization does not support partial gradient "
                f"reductions for parameter group {group.name or '<root>'!r}. Use automatic "
                "backward finalization for this configuration"
            )
        if (group.has_accumulated_grads and group.settings.requires_gradient_sync
                and group.params.is_hsdp and not group.settings.requires_all_reduce):
            raise RuntimeError(
                "FSDP manual backward finalization requires all-reduce for parameter group "
                f"{group.name or '<root>'!r}. Call set_requires_all_reduce(True) before "
                "finalization"
            )
    for group in reversed(groups):  # backward order, as FSDP2
        group.post_backward_outside_backward()
    if async_op:
        finalization.pending = True
        return GradientReductionHandle(state, finalization.generation)
    _wait(state.reduce_queue, finalization)
    return None


def _wait(reduce_queue: ReduceQueue, finalization: BackwardFinalization) -> None:
    reduce_queue.finish_all()
    finalization.end_iteration()


def reset(root_group: ParamGroup, groups: list[ParamGroup]) -> None:
    """``FSDPModule.reset_iter_state`` on the module of ``root_group`` (see [Note:
    backward finalization])."""
    if not root_group.settings.is_root:
        raise RuntimeError("reset_iter_state must be called on the root FSDP module")
    state = root_group.root_state
    if TORCH_HAS_MANUAL_FINALIZATION:
        state.reduce_queue.discard_all()
    else:  # FSDP2 before 2.15 has written their .grad by the time it resets
        state.reduce_queue.finish_all()
    for group in groups:
        group.reshard()
        group.reset_iter_state()
        if TORCH_HAS_MANUAL_FINALIZATION:
            for param in group.params.sharded_params:
                param.grad = None
    state.finalization.reset()


class GradientReductionHandle(_HandleBase):
    """``finalize_backward(async_op=True)``'s handle: ``wait()`` finishes the model's
    gradient reductions (writing ``.grad``) and ends the backward iteration. A
    ``torch.distributed.fsdp.GradientReductionHandle`` where torch has that class."""

    def __init__(self, state: object | None, generation: int) -> None:
        self._state = state
        self._generation = generation

    def wait(self) -> None:
        """Finishes the reductions; raises ``RuntimeError`` if ``reset_iter_state`` ran since."""
        state = self._state
        if state is None:
            return
        finalization = state.finalization
        if finalization.generation != self._generation or not finalization.pending:
            raise RuntimeError("This gradient reduction handle was invalidated")
        self._state = None
        _wait(state.reduce_queue, finalization)
