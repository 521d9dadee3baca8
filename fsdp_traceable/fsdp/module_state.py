"""What ``torch.distributed.pipelining`` finds at ``fully_shard.state(module)``.

[Note: pipeline schedules]
torch's pipeline stages and schedules take their FSDP path for any
``torch.distributed.fsdp.FSDPModule``, which ours are. Each microbatch's backward runs
after ``set_is_last_backward(False)``, ``set_reshard_after_backward(False)`` and
``set_requires_gradient_sync(False)`` (the groups accumulate unsharded gradients and
keep the parameters they gathered for backward); after the last one the stage sets
the three back to ``True`` and, outside any backward pass, reaches for FSDP2's state
through the composable-API registry: ``fully_shard.state(stage_module)``, then
``post_backward()`` on every parameter group of every state in
``state._state_ctx.all_states``, then ``state._root_post_backward_final_callback()``.
Interleaved schedules also call ``unshard(async_op=True)`` / ``reshard()`` per module.

Every ``fully_shard``-ed module of ours carries a :class:`FullyShardState` under that
registry key (in the module's own ``__dict__``, where torch's ``contract`` decorator
stores FSDP2's), so that code finds the same methods with FSDP2's meaning:
``post_backward()`` reduce-scatters the group's accumulated gradients (and frees the
parameters kept for backward when ``reshard_after_backward`` is set); the final callback
finishes the model's reductions in flight, which writes ``.grad``. torch itself is not
changed. Where torch has no such registry (no ``fully_shard.state``), nothing is
registered and the stage code, which then does not call it either, is unaffected.
"""

from __future__ import annotations

import weakref
from typing import Protocol

import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard

try:  # torch's composable-API registry: where fully_shard.state(module) looks
    from torch.distributed._composable.contract import STATE_KEY as _STATE_KEY
except ImportError:  # pragma: no cover - every supported torch has it
    _STATE_KEY = None
# The key fully_shard.state() reads: the function contract() decorated.
_STATE_FUNC = getattr(torch_fully_shard, "__wrapped__", None)


def register_state(module: nn.Module) -> bool:
    """Registers ``module``'s :class:`FullyShardState` where ``fully_shard.state`` finds it.

    Args:
        module: a module :func:`~fsdp_traceable.fully_shard` was applied to.

    Returns:
        Whether it was registered (``False`` where torch has no composable registry).
    """
    if _STATE_KEY is None or _STATE_FUNC is None or not hasattr(torch_fully_shard, "state"):
        return False
    states = module.__dict__.setdefault(_STATE_KEY, {})
    states[_STATE_FUNC] = FullyShardState(module)
    return True


class _OutsideBackward(Protocol):
    """What a stage's call needs of a parameter group (``ParamGroup``)."""

    def post_backward_outside_backward(self) -> None: ...


class _GroupBackward:
    """One parameter group as the stage code calls it: ``post_backward()``."""

    def __init__(self, group: _OutsideBackward) -> None:
        self._group = group

    def post_backward(self, *unused: object) -> None:
        """Reduce-scatters the group's accumulated gradients (FSDP2's meaning)."""
        self._group.post_backward_outside_backward()


class _StateContext:
    """FSDP2's ``_state_ctx``: the states of every ``fully_shard``-ed module under the
    module asked (itself first, pre-order), each group once."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    @property
    def all_states(self) -> list[FullyShardState]:
        states, seen = [], set()
        for m in self._module.modules():
            # A fully_shard-ed module of ours holds its group in its __dict__.
            if "_fsdp_group" in vars(m) and id(m._fsdp_group) not in seen:
                seen.add(id(m._fsdp_group))
                states.append(_state_of(m))
        return states

    @property
    def is_last_backward(self) -> bool:
        return True  # nothing of ours waits for it (see FSDPModule.set_is_last_backward)


class FullyShardState:
    """The part of FSDP2's ``FSDPState`` that torch's pipeline stages read (see
    [Note: pipeline schedules]). Holds its module weakly: a module's state never keeps
    it alive."""

    def __init__(self, module: nn.Module) -> None:
        self._module = weakref.ref(module)

    def _owner(self) -> nn.Module:
        module = self._module()
        if module is None:
            raise RuntimeError("the module of this fully_shard state was freed")
        return module

    @property
    def _state_ctx(self) -> _StateContext:
        return _StateContext(self._owner())

    @property
    def _fsdp_param_groups(self) -> list[_GroupBackward]:
        return [_GroupBackward(self._owner()._fsdp_group)]

    @property
    def _fsdp_param_group(self) -> _GroupBackward:  # torch before the list
        return self._fsdp_param_groups[0]

    def _root_post_backward_final_callback(self) -> None:
        """Finishes the model's gradient reductions in flight (writing ``.grad``), as
        FSDP2's end-of-backward callback waits for its reduce-scatters."""
        self._owner()._fsdp_group.finish_reductions()


def _state_of(module: nn.Module) -> FullyShardState:
    state = module.__dict__.get(_STATE_KEY, {}).get(_STATE_FUNC)
    return state if isinstance(state, FullyShardState) else FullyShardState(module)
