"""One ``fully_shard`` call's parameter group and its life cycle, as FSDP2's
``FSDPParamGroup``: unshard, wait for the unshard, reshard, pre/post forward and
pre/post backward.

``FSDPModule`` calls these methods and nothing else of the group's runtime state,
which is private here. The group owns its parameters (:class:`ParamShards`: what is
sharded, where, and bound to which modules), its settings (:class:`GroupSettings`),
its eager state (:class:`EagerState`), and its two paths, whose steps its phases call
(see [Note: the traced/eager seam]). A forward goes
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
from ..profiler_labels import labelled, phase
from . import activation_checkpointing, block_backward, group_all_gather
from .autograd_bridge import unshard_params
from .eager_phases import EagerPath
from .eager_state import EagerState
from .features.all_gather_extensions import PendingUnshard
from .forward_hooks import ForwardScope, cast_floats, prepare_inputs
from .gradient_reduction import gradients_to_reduce, start_reduce
from .group_settings import GroupSettings
from .group_state import GroupState
from .param_registration import ParamRegistration
from .param_shards import ParamShards
from .root_state import RootState
from .traced_phases import TracedPath

log = logging.getLogger(__name__)

# [Note: the traced/eager seam]
# A group's phase (unshard, pre/post forward, pre/post backward) is written once, in
# ParamGroup; the steps where the eager path and the traced path differ are asked of
# ``self._path()``, picked once per call by ``comm.use_traced_path()``: an
# :class:`EagerPath` (eager_phases.py: prefetch, parameters kept for backward and their
# saved-tensor tokens, the reduce queue, hidden post-accumulate-grad hooks) or a
# :class:`TracedPath` (traced_phases.py: functional collectives, the all-gather
# recomputed in backward, gradients returned through autograd). Both implement the same
# steps; no phase branches on the path itself. Dynamo evaluates the choice while
# tracing, so a graph holds the traced steps only.


class ParamGroup:
    """The parameters of one ``fully_shard``-ed module (or list of modules), its
    settings, and its runtime state and life cycle.

    The runtime state: a :class:`GroupState` with the unsharded parameters it holds
    (gathered by :meth:`unshard` for the next forward, or shared by a
    ``fully_shard([a, b])`` group's forward pass and the modules still to run), and, in
    eager mode only, an :class:`EagerState` (prefetches, parameters kept for backward,
    no-sync gradients).

    Args:
        params: the group's sharded parameters.
        settings: its settings.
        modules: its modules (several for ``fully_shard([a, b])``).
    """

    def __init__(self, params: ParamShards, settings: GroupSettings, *,
                 modules: list[nn.Module]) -> None:
        # What profiler labels and debug logs call the group: its module's path under
        # the root (set when the root links the groups; "" for the root).
        self.name = ""
        self.params = params
        self.settings = settings
        block_backward.track_group(self, self.params.shard_group)
        # The modules of the group (several for fully_shard([a, b])).
        self.modules: list[nn.Module] = list(modules)
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
        # Eager-only state between calls (prefetch, parameters kept for backward,
        # no-sync gradient accumulation), and the two paths' steps (see [Note: the
        # traced/eager seam]).
        self._eager_state = EagerState()
        self._eager_path = EagerPath(self, self._eager_state)
        # What the modules register (see [Note: registered parameters]).
        self._registration = ParamRegistration(params, self._eager_state)
        self._traced_path = TracedPath(self, self._eager_state)

    def _path(self) -> EagerPath | TracedPath:
        """The path this call runs (see [Note: the traced/eager seam])."""
        return self._traced_path if comm.use_traced_path() else self._eager_path

    @property
    def state(self) -> GroupState:
        """Where the group's unsharded parameters are (see :class:`GroupState`)."""
        return self._state

    @property
    def log_name(self) -> str:
        """What debug logs call the group: its module path under the root, the root by
        its class (``<FSDPTransformer>``)."""
        return self.name or f"<{type(self.modules[0]).__name__}>"

    def modules_to_run_forward(self) -> set[nn.Module]:
        """The group's modules whose forward has not run yet in the current pass."""
        return {m for m in self.modules if id(m) in self._modules_to_run}

    def configure(self, **settings: object) -> None:
        """Sets the group's settings (see [Note: group settings]).

        Args:
            settings: setting name -> new value, e.g. ``reshard_after_backward=False``.
        """
        self.settings.configure(**settings)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The group's next all-gather copy-in waits on ``event`` (used once)."""
        self.settings.streams.set_post_optim_event(event)

    def add_holder(self, owner: nn.Module, name: str, index: int) -> None:
        """Records that ``owner.<name>`` is parameter ``index`` of this group."""
        self.params.add_binding(owner, name, index)
        # For a replacement of the attribute (see [Note: replaced parameters]).
        owner.__dict__.setdefault("_fsdp_holders", {})[name] = self

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
        self.params.set_module_path(name)
        self.settings.configure(is_root=is_root)
        if not self.settings.explicit_backward_prefetch:
            self.settings.configure(prefetch_backward=prefetch_backward)
        self._root_state = root_state
        self._list_groups = list_groups

    def replace_param(self, owner: nn.Module, name: str, param: nn.Parameter | None,
                      register: Callable[[nn.Module, str, nn.Parameter], None]) -> None:
        """Sets ``owner.<name>`` (a holder of one of the group's parameters) to ``param``
        and adopts it, between steps. See [Note: replaced parameters].

        Args:
            owner: the module whose attribute is set.
            name: the attribute.
            param: the new parameter.
            register: ``register(module, name, param)`` registers it on one holder.

        Raises:
            TypeError, ValueError: ``param`` cannot replace the sharded parameter, or
                the group's parameters are in use (unsharded or being gathered).
        """
        index = self.params.check_replacement(owner, name, param)
        if self.params.is_bound or self.has_prefetch or self._state is not GroupState.SHARDED:
            raise ValueError(
                f"parameter {self.params.fqns[index]!r} was replaced while its group's "
                "parameters are unsharded (during forward, or after unshard()): replace it "
                "between steps, after reshard()"
            )
        self._registration.register_sharded()  # those kept after a forward are dropped below
        self.params.replace(index, param, register)
        self._eager_state.reset()

    # -- unshard, wait, reshard ------------------------------------------------------

    def unshard(self, async_op: bool = False) -> bool:
        """All-gathers the parameters for the group's next forward (``FSDPModule.unshard``).

        Args:
            async_op: eager, only issue the all-gather (as a prefetch); the next
                forward or :meth:`wait_for_unshard` finishes it.

        Returns:
            Whether :meth:`wait_for_unshard` still has to finish it.
        """
        if self._state is not GroupState.SHARDED or self.params.is_bound:
            return False
        if async_op and self._path().unshard_ahead():
            return True
        self.wait_for_unshard()
        return False

    def wait_for_unshard(self) -> None:
        """Finishes :meth:`unshard`: binds the unsharded parameters to the modules."""
        if self._state is not GroupState.SHARDED or self.params.is_bound:
            return
        self.params.check_materialized()
        with torch.enable_grad():  # the forward that uses them may need their backward
            unsharded = unshard_params(self, recompute_in_backward=False)
        self._set_state(GroupState.UNSHARDED, unsharded)
        self.params.bind(unsharded)
        self._registration.update()

    def reshard(self) -> None:
        """Frees the unsharded parameters: those :meth:`unshard` gathered, a prefetched
        all-gather, and (eager) parameters kept for or after backward."""
        if self._state is GroupState.UNSHARDED:
            self._set_state(GroupState.SHARDED)
            self.params.unbind()
        with phase("reshard", self.name):
            self._eager_path.finish_prefetch()
            self._eager_state.drop_unsharded()
        self._registration.update()

    def reshard_registered(self) -> None:
        """Before the modules' state dict is saved or loaded: reshards (:meth:`reshard`)
        if they register unsharded parameters that no forward is using, as FSDP2's
        state-dict pre-hooks do (see [Note: registered parameters])."""
        if self._registration.unsharded and (self._state is GroupState.UNSHARDED
                                           or not self.params.is_bound):
            self.reshard()

    def reset_iter_state(self) -> None:
        """Ends a ``fully_shard([a, b])`` forward pass left open and forgets no-sync
        gradients (after :meth:`reshard`)."""
        if self._state is GroupState.LIST_FORWARD:
            self._release_shared()
        self._eager_state.keep_accumulated_grads(None)
        self._eager_state.keep_partial_reduce_output(None)
        self._registration.update()

    # -- gathering ----------------------------------------------------------------------

    @property
    def has_prefetch(self) -> bool:
        """Whether an eager all-gather issued ahead of its use is in flight."""
        return self._eager_state.prefetched is not None

    def refresh_params(self) -> None:
        """Re-reads the sharded parameters from their modules (after ``module._apply``,
        e.g. ``to_empty``, may have replaced them); forgets what eager kept of the old ones."""
        self.params.refresh()
        self._eager_state.reset()
        self._registration.forget()  # the module's _apply resharded first

    def prefetch(self) -> None:
        """Eager: issues this group's all-gather now, to overlap the compute before it."""
        self._eager_path.prefetch()

    @property
    def region_eligible(self) -> bool:
        """Whether the group's forward may run as a forward region (see [Note: forward
        regions]): one module, no tensor-parallel parameters."""
        return len(self.modules) == 1 and not self.params.has_tp_params

    def compiled_on_its_own(self) -> bool:
        """Whether a module of the group was compiled by itself before ``fully_shard``
        (torch's ``module.compile()``): its graph gathers the parameters, so an eager
        prefetch from the module before it would never be used. (``FSDPModule.compile``
        compiles the compute alone; see [Note: per-module compile].)"""
        return any(getattr(m, "_compiled_call_impl", None) is not None for m in self.modules)

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...],
                   kept_piece: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The unsharded parameters (``param_dtype``), from a prefetch when one is in flight.

        Called by the group's autograd bridge (``UnshardParams``) with the sharded
        local tensors it differentiates through and, traced with
        ``reshard_after_forward=N``, the piece of :meth:`traced_post_forward_piece`,
        which it then re-gathers instead (see [Note: the post-forward piece, compiled]).
        """
        return self._path().all_gather(sharded_locals, kept_piece)

    def traced_post_forward_piece(self, sharded_locals: list[torch.Tensor]) -> torch.Tensor:
        """Traced, ``reshard_after_forward=N``: the piece the forward and the backward
        re-gather from (see [Note: the post-forward piece, compiled])."""
        return self._traced_path.post_forward_piece(sharded_locals)

    def start_all_gather(self) -> PendingUnshard:
        """Starts the group's all-gather (eager), from the post-forward piece when one is
        kept; finish it with :meth:`finish_all_gather`."""
        return self._eager_path.start_all_gather()

    @labelled("all_gather_copy_out")
    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]:
        """Waits for the all-gather and returns the unsharded parameters (post hooks run),
        in the kept storage with ``set_keep_unsharded_storage(True)``."""
        unsharded = group_all_gather.finish_all_gather(pending)
        if self.settings.keep_unsharded_storage:
            return self._eager_state.kept_storage.refill(unsharded)
        return unsharded

    # -- forward ------------------------------------------------------------------------

    @labelled("pre_forward")
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict
                    ) -> tuple[tuple, dict, ForwardScope]:
        """Casts the inputs and gathers the group's unsharded parameters.

        The first forward of a pass gathers (or takes what :meth:`unshard` gathered and
        bound); a forward that runs while the parameters are bound (a registered forward
        method calling ``forward``, or the second module of a ``fully_shard([a, b])``
        group) reuses them. Parameters it gathers are not bound yet: the caller binds
        them (:meth:`bind_forward`) or runs a forward region, which binds its own.

        Args:
            module: the group's module whose forward starts.
            args: its positional arguments.
            kwargs: its keyword arguments.

        Returns:
            The (cast) arguments and what :meth:`post_forward` releases.
        """
        if not self.settings.is_root:
            return self._start_forward(module, args, kwargs)
        self._root_state.root_forwards += 1
        try:
            return self._start_forward(module, args, kwargs)
        except BaseException:
            self._root_state.root_forwards -= 1
            raise

    def _start_forward(self, module: nn.Module, args: tuple, kwargs: dict
                       ) -> tuple[tuple, dict, ForwardScope]:
        path = self._path()
        path.begin_forward()
        self.params.check_materialized()
        args, kwargs = prepare_inputs(module, args, kwargs, self.params.device_type,
                                      self.params.mp_policy)
        # A fully_shard([a, b]) group's modules share one pass inside the root's forward;
        # one of them called on its own after it (a chunked loss calling the head per
        # chunk) is a pass of its own, as it is for FSDP2 and for the module sharded alone.
        shared = len(self.modules) > 1 and self._root_state.root_forwards > 0
        bound = True
        if self._state is GroupState.UNSHARDED:
            unsharded = self._unsharded
            self._set_state(GroupState.SHARDED)
        elif self._state is GroupState.LIST_FORWARD:
            return args, kwargs, ForwardScope(None, path.saved_tensor_hooks())
        elif self.params.is_bound:
            return args, kwargs, ForwardScope(None, None)
        else:
            reshard = self.settings.reshard_after_forward and torch.is_grad_enabled()
            unsharded = path.gather_for_forward(reshard)
            bound = False
        if shared:
            self._set_state(GroupState.LIST_FORWARD, unsharded)
            self._modules_to_run = {id(m) for m in self.modules}
        path.after_forward_gather(module, unsharded)
        return args, kwargs, ForwardScope(unsharded, path.saved_tensor_hooks(), bound)

    def bind_forward(self, scope: ForwardScope) -> ForwardScope:
        """Binds the parameters :meth:`pre_forward` gathered (if not bound yet): the
        forward reads them through its modules' attributes.

        Returns:
            ``scope``, bound.
        """
        if scope.bound:
            return scope
        self.params.bind(scope.unsharded)
        self._registration.update()
        return scope._replace(bound=True)

    def unbind_forward(self, scope: ForwardScope) -> ForwardScope:
        """Unbinds them (if bound), for a forward region, which binds its own.

        Returns:
            ``scope``, unbound.
        """
        if not scope.bound:
            return scope
        self.params.unbind()
        self._registration.update()
        return scope._replace(bound=False)

    @labelled("post_forward")
    def post_forward(self, module: nn.Module, scope: ForwardScope, output: Any) -> Any:
        """Releases what :meth:`pre_forward` bound (per the group's pass) and casts the output.

        Args:
            module: the group's module whose forward ended.
            scope: what its :meth:`pre_forward` returned.
            output: its output.

        Returns:
            ``output``, cast to ``mp_policy.output_dtype`` if set.
        """
        if scope.hooks is not None:
            scope.hooks.__exit__(None, None, None)
        if self._state is GroupState.LIST_FORWARD:
            self._modules_to_run.discard(id(module))
            if not self._modules_to_run:
                self._release_shared()
        elif scope.unsharded is not None:
            self._release(scope.unsharded, scope.bound)
        if self.settings.is_root:
            self._root_state.root_forwards -= 1
            if scope.unsharded is not None:
                # FSDP2 ends the pass of groups whose modules did not all run at the
                # root's end.
                for other in self._list_groups:
                    if other._state is GroupState.LIST_FORWARD:
                        other._release_shared()
                        other._registration.update()
        if torch.compiler.is_compiling():
            self._registration.register_sharded()
        else:
            self._registration.update()
            self._path().hook_backward_start(output)
        if self.params.mp_policy.output_dtype is not None:
            output = cast_floats(output, self.params.mp_policy.output_dtype)
        return output

    def abort_forward(self, scope: ForwardScope) -> None:
        """Unbinds after a forward that raised, so the next call starts clean."""
        if scope.hooks is not None:
            scope.hooks.__exit__(None, None, None)
        if self.settings.is_root:
            self._root_state.root_forwards -= 1
        if self._state is GroupState.LIST_FORWARD:
            self._release_shared()
        elif scope.unsharded is not None:
            self._release(scope.unsharded, scope.bound)
        self._registration.update()

    def _release_shared(self) -> None:
        """Ends a ``fully_shard([a, b])`` group's forward pass."""
        unsharded = None
        if self._state is GroupState.LIST_FORWARD:
            unsharded = self._unsharded
            self._set_state(GroupState.SHARDED)
        self._modules_to_run = set()
        if unsharded is not None:
            self._release(unsharded)

    def _release(self, unsharded: tuple[torch.Tensor, ...], bound: bool = True) -> None:
        self._path().release(unsharded, bound)

    # -- backward -------------------------------------------------------------------------

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """Eager no-sync microbatches' gradients (by parameter index), for a compiled
        forward to pass to its backward as inputs; clears them."""
        return self._eager_state.take_accumulated_grads()

    def pre_backward(self) -> list[torch.Tensor]:
        """Eager: the parameters, re-gathered once for this group's backward (by the
        first saved tensor its backward unpacks), then prefetches per the group's order."""
        if self._eager_state.unsharded_for_backward is None:
            self._unshard_for_backward()
            if not torch.compiler.is_compiling():  # no frame for Dynamo to inline
                self._registration.update()
        return self._eager_state.unsharded_for_backward

    def param_in_backward(self, owner: nn.Module, name: str) -> torch.Tensor:
        """What ``owner.<name>`` reads while a backward runs and the group's parameters
        are not bound: its unsharded parameter, gathered once for the group's backward
        (see [Note: activation checkpointing])."""
        index = self.params.binding_index(owner, name)
        with activation_checkpointing.outside_selective_checkpoint():
            with torch.no_grad():
                unsharded = self.pre_backward()[index]
            # Requiring grad as forward's did, so the recompute saves what forward saved.
            if self.params.sharded_params[index].requires_grad:
                unsharded = unsharded.detach().requires_grad_()
            return self.params.bound_value(index, unsharded)

    @labelled("pre_backward")
    def _unshard_for_backward(self) -> None:
        if not self.settings.unshard_in_backward:
            raise RuntimeError(
                f"the backward of the group of {self.params.fqns[:3]} reads its parameters, but "
                "set_unshard_in_backward(False) was called on its module: set it back "
                "to True (False is only for modules whose backward needs no parameters)"
            )
        self._path().gather_for_backward()

    def end_backward(self) -> None:
        """The end of the backward pass the group gathered its parameters for: frees
        them with ``reshard_after_backward``."""
        if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
            log.debug("group %s after backward: %s", self.log_name,
                      "reshard" if self.settings.reshard_after_backward
                      else "keep the unsharded parameters for the next forward")
        if self.settings.reshard_after_backward:
            with phase("reshard", self.name):
                self._eager_state.drop_for_backward()
            if not torch.compiler.is_compiling():  # no frame for Dynamo to inline
                self._registration.update()

    @labelled("post_backward")
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
        # [Note: a traced backward mutates no Python state]
        # Dynamo refuses side effects inside an autograd.Function's backward, and a
        # compiled-autograd graph replays without running this Python: a traced backward
        # returns its sharded gradients through autograd and changes nothing else. Every
        # eager state it reads is empty then (end_backward, take_accumulated_grads and
        # take_partial_reduce_output change nothing), and the settings that keep
        # gradients across backward calls (no gradient sync, HSDP without its
        # all-reduce) raise under a traced backward (gradient_reduction).
        path = self._path()
        path.begin_post_backward()
        self._eager_state.end_backward(self.settings.reshard_after_backward)
        if torch.compiler.is_compiling():
            # A compiled-autograd backward after an eager forward that kept them: the
            # sharded parameters again, a side effect replayed after the graph (traced
            # only where the flag was set when it traced).
            self._registration.register_sharded()
        else:
            self._registration.update()
        if not accumulated:
            accumulated = self._eager_state.take_accumulated_grads()
        grads = gradients_to_reduce(self.params, self.settings, unsharded_grads, accumulated)
        sharded_grads: list[torch.Tensor | None] = [None] * len(self.params.sharded_params)
        if not self.settings.requires_gradient_sync:
            self._eager_state.keep_accumulated_grads(grads)
            return sharded_grads
        if not grads:
            return sharded_grads
        indices = sorted(grads)
        pending = start_reduce(self.params, self.settings, grads, indices,
                               self._eager_state.take_partial_reduce_output(), name=self.name)
        return path.finish_reduce(pending, indices, sharded_grads)

    # -- backward finalization (see [Note: backward finalization]) ------------------------

    @property
    def root_state(self) -> RootState:
        """What the model shares between its groups (see [Note: per-model state])."""
        return self._root_state

    @property
    def has_accumulated_grads(self) -> bool:
        """Whether eager no-sync backwards left unsharded gradients to reduce."""
        return self._eager_state.has_accumulated_grads

    @property
    def has_partial_reduce_output(self) -> bool:
        """HSDP: whether backwards without the all-reduce left reduce-scatter output."""
        return self._eager_state.has_partial_reduce_output

    @property
    def holds_unsharded(self) -> bool:
        """Whether the group holds its unsharded parameters (FSDP2's
        ``FSDPParamGroup.is_unsharded``): gathered by ``unshard()`` or a forward and not
        resharded yet, or kept past a backward (``reshard_after_forward=False``,
        ``reshard_after_backward=False``); not the piece ``reshard_after_forward=N`` keeps."""
        return (self._state is not GroupState.SHARDED or self.params.is_bound
                or self._eager_state.holds_unsharded)

    def drop_kept_storage(self) -> None:
        """Frees the storage ``set_keep_unsharded_storage(True)`` kept."""
        self._eager_state.kept_storage.drop()

    def post_backward_outside_backward(self) -> None:
        """Eager, outside a backward pass: FSDP2's ``FSDPParamGroup.post_backward()``, which
        torch's pipeline stages call after their microbatches' no-sync backwards (see
        [Note: pipeline schedules]).

        With gradient sync on, the gradients accumulated so far are reduce-scattered (the
        model's reduce queue finishes them); with ``reshard_after_backward``, the
        parameters kept for backward are freed. A group with nothing accumulated reduces
        nothing, so a second call is a no-op.
        """
        if self._eager_state.has_accumulated_grads and self.settings.requires_gradient_sync:
            self.post_backward((None,) * len(self.params.sharded_params))
        elif self.settings.reshard_after_backward:
            self._eager_state.end_backward(reshard_after_backward=True)
        self._registration.update()

    def hide_post_accumulate_hooks(self) -> None:
        """After its backward: autograd must not run the parameters'
        post-accumulate-grad hooks when an eager reduction does (see [Note:
        post-accumulate-grad hooks in eager backward])."""
        self._path().hide_post_accumulate_hooks()

    def finish_reductions(self) -> None:
        """Finishes the model's eager gradient reductions in flight (writing ``.grad``),
        as FSDP2's root post-backward callback waits for its reduce-scatters."""
        self._root_state.reduce_queue.finish_all()
