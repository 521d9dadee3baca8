"""One ``fully_shard`` call's parameter group and its life cycle, as FSDP2's
``FSDPParamGroup``: unshard, wait for the unshard, reshard, pre/post forward and
pre/post backward.

``FSDPModule`` calls these methods and nothing else of the group's runtime state,
which is private here (what the group is, and its settings, are
:class:`~.sharded_group.ShardedGroup`'s; how it gathers its parameters,
:class:`~.group_all_gather.GatheringGroup`'s). A forward goes
``FSDPModule.forward -> ParamGroup.pre_forward -> unshard_params -> collectives``;
a backward ``UnshardParams.backward -> ParamGroup.post_backward -> collectives`` and,
eager, on to the model's reduction queue, which writes ``.grad``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from ..collectives import comm
from ..collectives.reduce import finish_foreach_reduce
from ..profiler_labels import phase
from . import post_accumulate_hooks
from .autograd_bridge import unshard_params
from .forward_hooks import ForwardScope, cast_floats, prepare_inputs
from .gradient_reduction import gradients_to_reduce, start_reduce
from .group_all_gather import GatheringGroup
from .group_state import GroupState
from .reduce_queue import GradientTarget
from .root_state import RootState
from .sharded_params import check_replacement
from .unsharded_binding import bind_unsharded, is_bound, unbind_unsharded

log = logging.getLogger(__name__)


class ParamGroup(GatheringGroup):
    """A :class:`~.group_all_gather.GatheringGroup` with its runtime state and life cycle.

    The runtime state: a :class:`GroupState` with the unsharded parameters it holds
    (gathered by :meth:`unshard` for the next forward, or shared by a
    ``fully_shard([a, b])`` group's forward pass and the modules still to run), and, in
    eager mode only, the gathering's ``EagerState``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # What the model shares between its groups (see [Note: per-model state]); the
        # group is its own model until the root's fully_shard links it.
        self._root_state = RootState()
        # The unsharded parameters the state holds (None when SHARDED) and, in a
        # LIST_FORWARD pass, the modules whose forward has not run yet.
        self._state = GroupState.SHARDED
        self._unsharded: tuple[torch.Tensor, ...] | None = None
        self._modules_to_run: set[int] = set()
        # On the root group: the fully_shard([a, b]) groups below it, whose forward
        # pass ends with the root's forward at the latest.
        self._list_groups: list[ParamGroup] = []
        # Whether an eager backward hid post-accumulate-grad hooks not yet restored.
        self._hooks_hidden = False

    def _set_state(self, state: GroupState,
                   unsharded: tuple[torch.Tensor, ...] | None = None) -> None:
        assert (state is GroupState.SHARDED) == (unsharded is None), state
        self._state, self._unsharded = state, unsharded

    def link(self, *, name: str, is_root: bool, prefetch_backward: Callable[[], None] | None,
             root_state: RootState, list_groups: list[ParamGroup]) -> None:
        """Joins the model under the root (the root's ``fully_shard`` calls this on
        every group under it).

        Args:
            name: the group's module path under the root (``""`` for the root).
            is_root: whether this is the root group.
            prefetch_backward: what the group's backward prefetches, unless set
                explicitly already.
            root_state: the model state the groups under the root share.
            list_groups: on the root, the ``fully_shard([a, b])`` groups below it.
        """
        self.name = name
        self.is_root = is_root
        self._root_state = root_state
        if not self.explicit_backward_prefetch:
            self.prefetch_backward = prefetch_backward
        self._list_groups = list_groups

    # [Note: replaced parameters]
    # ``module.weight = nn.Parameter(...)`` on a module holding a sharded parameter, or
    # ``load_state_dict(assign=True)``, goes through ``register_parameter``, which the
    # classes fully_shard swaps in override (``unsharded_binding.register_parameter``):
    # the new parameter is checked here first (an nn.Parameter(DTensor) with the old
    # layout, else TypeError/ValueError, nothing changed), then set on every holder of a
    # tied parameter and adopted by the group, whose next all-gather gathers it. FSDP2
    # adopts it at its lazy init (the first forward) and after load_state_dict; a later
    # replacement it silently reverts at its next unshard, where ours adopts it too.

    def replace_param(self, owner: nn.Module, name: str, param: nn.Parameter | None,
                      register: Callable[[nn.Module, str, nn.Parameter], None]) -> None:
        """Sets ``owner.<name>`` (a holder of one of the group's parameters) to ``param``
        and adopts it. See [Note: replaced parameters].

        Args:
            owner: the module whose attribute is set.
            name: the attribute.
            param: the new parameter.
            register: ``register(module, name, param)`` registers it on one holder.

        Raises:
            TypeError, ValueError: ``param`` cannot replace the sharded parameter, or
                the group's parameters are in use (unsharded or being gathered).
        """
        index = next(i for o, n, i in self.bindings if o is owner and n == name)
        check_replacement(self.fqns[index], self.sharded_params[index], param)
        if is_bound(self) or self.has_prefetch or self._state is not GroupState.SHARDED:
            raise ValueError(
                f"parameter {self.fqns[index]!r} was replaced while its group's parameters "
                "are unsharded (during forward, or after unshard()): replace it between "
                "steps, after reshard()"
            )
        for holder, holder_name, i in self.bindings:
            if i == index:
                register(holder, holder_name, param)
        self.refresh_params()

    # -- unshard, wait, reshard ------------------------------------------------------

    def unshard(self, async_op: bool = False) -> bool:
        """All-gathers the parameters for the group's next forward (``FSDPModule.unshard``).

        Args:
            async_op: eager, only issue the all-gather (as a prefetch); the next
                forward or :meth:`wait_for_unshard` finishes it.

        Returns:
            Whether :meth:`wait_for_unshard` still has to finish it.
        """
        if self._state is not GroupState.SHARDED or is_bound(self):
            return False
        if async_op and not comm.use_traced_path():
            self.prefetch()
            return True
        self.wait_for_unshard()
        return False

    def wait_for_unshard(self) -> None:
        """Finishes :meth:`unshard`: binds the unsharded parameters to the modules."""
        if self._state is not GroupState.SHARDED or is_bound(self):
            return
        self._check_materialized()
        with torch.enable_grad():  # the forward that uses them may need their backward
            unsharded = unshard_params(self, recompute_in_backward=False)
        self._set_state(GroupState.UNSHARDED, unsharded)
        bind_unsharded(self, unsharded)

    def reshard(self) -> None:
        """Frees the unsharded parameters: those :meth:`unshard` gathered, a prefetched
        all-gather, and (eager) parameters kept for or after backward."""
        if self._state is GroupState.UNSHARDED:
            self._set_state(GroupState.SHARDED)
            unbind_unsharded(self)
        with phase("reshard", self.name):
            self._drop_prefetched()
            self._eager.drop_unsharded()

    def reset_iter_state(self) -> None:
        """Ends a ``fully_shard([a, b])`` forward pass left open and forgets no-sync
        gradients (after :meth:`reshard`)."""
        if self._state is GroupState.LIST_FORWARD:
            self._release_shared()
        self._eager.keep_accumulated_grads(None)

    # -- forward ------------------------------------------------------------------------

    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                    ) -> tuple[tuple, dict, ForwardScope]:
        """Casts the inputs and binds the group's unsharded parameters to its modules.

        The first forward of a pass gathers (or takes what :meth:`unshard` gathered); a
        forward that runs while the parameters are bound (a registered forward method
        calling ``forward``, or the second module of a ``fully_shard([a, b])`` group)
        reuses them.

        Args:
            module: the group's module whose forward starts.
            args: its positional arguments.
            kwargs: its keyword arguments.

        Returns:
            The (cast) arguments and what :meth:`post_forward` releases.
        """
        with phase("pre_forward", self.name):
            return self._pre_forward(module, args, kwargs)

    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                     ) -> tuple[tuple, dict, ForwardScope]:
        traced = comm.use_traced_path()
        if self._hooks_hidden and not traced:  # only an eager backward hides them
            self.restore_post_accumulate_hooks()
        self._check_materialized()
        args, kwargs = prepare_inputs(self, module, args, kwargs, traced)
        shared = len(self.modules) > 1
        if self._state is GroupState.UNSHARDED:
            unsharded = self._unsharded
            self._set_state(GroupState.SHARDED)
        elif self._state is GroupState.LIST_FORWARD:
            return args, kwargs, ForwardScope(None, self._enter_hooks(traced))
        elif is_bound(self):
            return args, kwargs, ForwardScope(None, None)
        else:
            reshard = self.reshard_after_forward and torch.is_grad_enabled()
            unsharded = unshard_params(self, recompute_in_backward=reshard and traced)
            bind_unsharded(self, unsharded)
        if shared:
            self._set_state(GroupState.LIST_FORWARD, unsharded)
            self._modules_to_run = {id(m) for m in self.modules}
        if not traced:
            for child in module._fsdp_next_groups:
                if child._state is not GroupState.UNSHARDED:  # else unshard() gathered it
                    child.prefetch()
            if self.reshard_after_forward:
                self._root_state.saved_unsharded.register(self, list(unsharded))
            elif torch.is_grad_enabled() and self.has_trainable_params:
                # Its backward reshards them, or keeps them for the next forward; until
                # then forwards reuse them, as FSDP2's unsharded group.
                self._eager.keep_forward_unsharded(tuple(unsharded), self._local_versions())
        return args, kwargs, ForwardScope(unsharded, self._enter_hooks(traced))

    def post_forward(self, module: nn.Module, scope: ForwardScope, output: Any) -> Any:
        """Releases what :meth:`pre_forward` bound (per the group's pass) and casts the output.

        Args:
            module: the group's module whose forward ended.
            scope: what its :meth:`pre_forward` returned.
            output: its output.

        Returns:
            ``output``, cast to ``mp_policy.output_dtype`` if set.
        """
        with phase("post_forward", self.name):
            return self._post_forward(module, scope, output)

    def _post_forward(self, module: nn.Module, scope: ForwardScope, output: Any) -> Any:
        if scope.hooks is not None:
            scope.hooks.__exit__(None, None, None)
        if len(self.modules) > 1:
            self._modules_to_run.discard(id(module))
            if not self._modules_to_run:
                self._release_shared()
        elif scope.unsharded is not None:
            self._release(scope.unsharded)
        if self.is_root and scope.unsharded is not None:
            # FSDP2 ends the pass of groups whose modules did not all run at the root's end.
            for other in self._list_groups:
                if other._state is GroupState.LIST_FORWARD:
                    other._release_shared()
        if self.mp_policy.output_dtype is not None:
            output = cast_floats(output, self.mp_policy.output_dtype)
        return output

    def abort_forward(self, scope: ForwardScope) -> None:
        """Unbinds after a forward that raised, so the next call starts clean."""
        if scope.hooks is not None:
            scope.hooks.__exit__(None, None, None)
        if len(self.modules) > 1:
            self._release_shared()
        elif scope.unsharded is not None:
            self._release(scope.unsharded)

    def _release_shared(self) -> None:
        """Ends a ``fully_shard([a, b])`` group's forward pass."""
        unsharded = None
        if self._state is GroupState.LIST_FORWARD:
            unsharded = self._unsharded
            self._set_state(GroupState.SHARDED)
        self._modules_to_run = set()
        if unsharded is not None:
            self._release(unsharded)

    def _release(self, unsharded: tuple[torch.Tensor, ...]) -> None:
        if comm.use_traced_path():
            unbind_unsharded(self)
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group %r after forward: %s", self.name,
                      "reshard (backward re-gathers)" if self.reshard_after_forward
                      else "keep the unsharded parameters for backward")
        if not self.reshard_after_forward:
            unbind_unsharded(self)
            return
        with phase("reshard", self.name):
            self._root_state.saved_unsharded.unregister(list(unsharded))
            # Parameters kept after a backward served this forward; like FSDP2, it
            # reshards them now and backward gathers again.
            self._eager.drop_for_backward()
            unbind_unsharded(self)

    def _enter_hooks(self, traced: bool) -> Any:
        """Eager reshard-after-forward: autograd saves tokens for the unsharded parameters."""
        if traced or not self.reshard_after_forward:
            return None
        hooks = self._root_state.saved_unsharded.hooks()
        hooks.__enter__()
        return hooks

    # -- backward -------------------------------------------------------------------------

    @property
    def has_trainable_params(self) -> bool:
        """Whether a backward can reach this group's gradient reduction."""
        return any(p.requires_grad for p in self.sharded_params)

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """Eager no-sync microbatches' gradients (by parameter index), for a compiled
        forward to pass to its backward as inputs; clears them."""
        return self._eager.take_accumulated_grads()

    def pre_backward(self) -> list[torch.Tensor]:
        """Eager: the parameters, re-gathered once for this group's backward (by the
        first saved tensor its backward unpacks), then prefetches per the group's order."""
        if self._eager.unsharded_for_backward is None:
            with phase("pre_backward", self.name):
                self._unshard_for_backward()
        return self._eager.unsharded_for_backward

    def _unshard_for_backward(self) -> None:
        if not self.unshard_in_backward:
            raise RuntimeError(
                f"the backward of the group of {self.fqns[:3]} reads its parameters, but "
                "set_unshard_in_backward(False) was called on its module: set it back "
                "to True (False is only for modules whose backward needs no parameters)"
            )
        pending = self._take_prefetched()
        if pending is None:
            pending = self.start_all_gather()
        self._eager.keep_for_backward(self.finish_all_gather(pending))
        if torch._C._current_graph_task_id() != -1:
            # Also frees them for a group without trainable parameters, whose
            # backward never reaches post_backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # Prefetch only once this group's all-gather buffer is freed: the peak then
        # holds one in-flight buffer, not two.
        if self.prefetch_backward is not None:
            self.prefetch_backward()

    def _end_backward(self) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group %r after backward: %s", self.name,
                      "reshard" if self.reshard_after_backward
                      else "keep the unsharded parameters for the next forward")
        if self.reshard_after_backward:
            with phase("reshard", self.name):
                self._eager.drop_for_backward()

    def post_backward(
        self,
        unsharded_grads: tuple[torch.Tensor | None, ...],
        accumulated: dict[int, torch.Tensor] | None = None,
    ) -> list[torch.Tensor | None]:
        """Reduce-scatters the trainable parameters' gradients into sharded gradients.

        Args:
            unsharded_grads: the group's backward's gradient per parameter.
            accumulated: earlier no-sync microbatches' unsharded gradients, by parameter
                index, passed in by a compiled backward; eager takes them from the
                group's state.

        Returns:
            Traced, the sharded gradient per parameter (``None`` for those without);
            eager, all ``None``: the model's reduction queue writes ``.grad``.
        """
        with phase("post_backward", self.name):
            return self._post_backward(unsharded_grads, accumulated)

    def post_backward_outside_backward(self) -> None:
        """Eager, outside a backward pass: FSDP2's ``FSDPParamGroup.post_backward()``, which
        torch's pipeline stages call after their microbatches' no-sync backwards (see
        [Note: pipeline schedules]).

        With gradient sync on, the gradients accumulated so far are reduce-scattered (the
        model's reduce queue finishes them); with ``reshard_after_backward``, the
        parameters kept for backward are freed. A group with nothing accumulated reduces
        nothing, so a second call is a no-op.
        """
        if self._eager.has_accumulated_grads and self.requires_gradient_sync:
            self.post_backward((None,) * len(self.sharded_params))
        elif self.reshard_after_backward:
            self._eager.end_backward(reshard_after_backward=True)

    def hide_post_accumulate_hooks(self) -> None:
        """Eager backward: autograd must not run the parameters' post-accumulate-grad
        hooks; the reduction does (see [Note: post-accumulate-grad hooks in eager backward])."""
        if post_accumulate_hooks.hide(self.sharded_params):
            self._hooks_hidden = True

    def restore_post_accumulate_hooks(self) -> None:
        """Puts back what :meth:`hide_post_accumulate_hooks` took (none ran meanwhile)."""
        self._hooks_hidden = False
        for param in self.sharded_params:
            post_accumulate_hooks.restore(param)

    def finish_reductions(self) -> None:
        """Finishes the model's eager gradient reductions in flight (writing ``.grad``),
        as FSDP2's root post-backward callback waits for its reduce-scatters."""
        self._root_state.reduce_queue.finish_all()

    def _post_backward(
        self,
        unsharded_grads: tuple[torch.Tensor | None, ...],
        accumulated: dict[int, torch.Tensor] | None,
    ) -> list[torch.Tensor | None]:
        # [Note: a traced backward mutates no Python state]
        # Dynamo refuses side effects inside an autograd.Function's backward, and a
        # compiled-autograd graph replays without running this Python: a traced backward
        # returns its sharded gradients through autograd and changes nothing else. Every
        # eager state it reads is empty then (end_backward, take_accumulated_grads and
        # take_partial_reduce_output change nothing), and the settings that keep
        # gradients across backward calls (no gradient sync, HSDP without its
        # all-reduce) raise under a traced backward (gradient_reduction).
        self._eager.end_backward(self.reshard_after_backward)
        if not accumulated:
            accumulated = self._eager.take_accumulated_grads()
        grads = gradients_to_reduce(self, unsharded_grads, accumulated)
        sharded_grads: list[torch.Tensor | None] = [None] * len(self.sharded_params)
        if not self.requires_gradient_sync:
            self._eager.keep_accumulated_grads(grads)
            return sharded_grads
        if not grads:
            return sharded_grads
        indices = sorted(grads)
        pending = start_reduce(self, grads, indices, self._eager.take_partial_reduce_output())
        if not comm.use_traced_path():
            # Eager, as FSDP2: the reduce-scatter runs while autograd computes the next
            # groups' gradients; the gradients reach .grad when it is finished (by the
            # next group's reduction or at the end of backward), not through autograd.
            self._root_state.reduce_queue.put(
                pending, GradientTarget(self.sharded_params, indices,
                                        self._eager.keep_partial_reduce_output))
            return sharded_grads
        result = finish_foreach_reduce(pending)
        for i, grad in zip(indices, result.sharded_grads):
            sharded_grads[i] = grad
        return sharded_grads
