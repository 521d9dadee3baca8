"""One ``fully_shard`` call's parameter group and its life cycle, as FSDP2's
``FSDPParamGroup``: unshard, wait for the unshard, reshard, pre/post forward and
pre/post backward.

``FSDPModule`` calls these methods and nothing else of the group's runtime state,
which is private here. The group owns its parameters (:class:`ParamShards`: what is
sharded, where, and bound to which modules), its settings (:class:`GroupSettings`),
and its eager state (:class:`EagerState`). A forward goes
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
from ..profiler_labels import labelled, phase
from ..tracing import in_backward
from . import activation_checkpointing, block_backward, group_all_gather, post_accumulate_hooks
from .autograd_bridge import unshard_params
from .eager_state import EagerState
from .features.all_gather_extensions import PendingUnshard
from .forward_hooks import ForwardScope, cast_floats, prepare_inputs
from .gradient_reduction import gradients_to_reduce, start_reduce
from .group_settings import GroupSettings
from .group_state import GroupState
from .param_shards import ParamShards
from .reduce_queue import GradientTarget
from .root_state import RootState

log = logging.getLogger(__name__)


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
        # no-sync gradient accumulation).
        self._eager = EagerState()
        # Whether an eager backward hid post-accumulate-grad hooks not yet restored.
        self._hooks_hidden = False

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
        self.params.replace(index, param, register)
        self._eager.reset()

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
        if async_op and not comm.use_traced_path():
            self.prefetch()
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

    def reshard(self) -> None:
        """Frees the unsharded parameters: those :meth:`unshard` gathered, a prefetched
        all-gather, and (eager) parameters kept for or after backward."""
        if self._state is GroupState.UNSHARDED:
            self._set_state(GroupState.SHARDED)
            self.params.unbind()
        with phase("reshard", self.name):
            self._finish_prefetch()
            self._eager.drop_unsharded()

    def reset_iter_state(self) -> None:
        """Ends a ``fully_shard([a, b])`` forward pass left open and forgets no-sync
        gradients (after :meth:`reshard`)."""
        if self._state is GroupState.LIST_FORWARD:
            self._release_shared()
        self._eager.keep_accumulated_grads(None)
        self._eager.keep_partial_reduce_output(None)

    # -- gathering ----------------------------------------------------------------------

    @property
    def has_prefetch(self) -> bool:
        """Whether an eager all-gather issued ahead of its use is in flight."""
        return self._eager.prefetched is not None

    def refresh_params(self) -> None:
        """Re-reads the sharded parameters from their modules (after ``module._apply``,
        e.g. ``to_empty``, may have replaced them); forgets what eager kept of the old ones."""
        self.params.refresh()
        self._eager.reset()

    def prefetch(self) -> None:
        """Eager: issues this group's all-gather now, to overlap the compute before it."""
        if not self.params.sharded_params or self.compiled_on_its_own():
            return
        self.params.check_materialized()
        if self._eager.holds_forward_unsharded(self.params.local_versions):
            return  # still unsharded from a forward that keeps them, as FSDP2's group
        if self._eager.prefetched is None and self._eager.unsharded_for_backward is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefetch: all-gather of group %s issued early", self.log_name)
            self._eager.keep_prefetched(self.start_all_gather(), self.params.local_versions())
            if in_backward():
                # As FSDP2's finalize_backward: a backward prefetch this backward did not
                # use (its module's backward read no parameter) is waited for at the
                # backward's end, not carried, buffer and all, into the next step.
                torch.autograd.Variable._execution_engine.queue_callback(self._finish_prefetch)

    def _finish_prefetch(self) -> None:
        """Waits for the prefetched all-gather, if one is in flight, and drops it unused."""
        group_all_gather.complete_all_gather(self._eager.take_prefetched()[0])

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
        if comm.use_traced_path():
            if kept_piece is not None:
                return self.settings.post_forward_mesh.traced_unsharded(kept_piece,
                                                                        self.params.layout)
            pending = group_all_gather.start_all_gather(
                self.params, list(sharded_locals), streams=None,
                all_gather_comm=self.settings.all_gather_comm)
            return self.finish_all_gather(pending)
        if self._eager.unsharded_for_backward is not None:
            # Kept by a backward with reshard_after_backward=False: like FSDP2, the
            # next forward uses them whatever the flag says now.
            return self._eager.unsharded_for_backward
        versions = self.params.local_versions()
        kept = self._eager.forward_unsharded(versions)
        if kept is not None:
            # Gathered by an earlier forward of this group, which does not reshard after
            # forward, and not resharded by a backward since: like FSDP2, still unsharded.
            return kept
        pending = self._take_prefetched(versions)
        if pending is None:
            pending = self.start_all_gather()
        unsharded = self.finish_all_gather(pending)
        post_forward_mesh = self.settings.post_forward_mesh
        if post_forward_mesh is not None:
            # FSDP2 keeps this piece from the forward's end until the next all-gather;
            # it is taken now, while the all-gather output is alive.
            self._eager.keep_piece(post_forward_mesh.keep(pending), versions)
        return unsharded

    def traced_post_forward_piece(self, sharded_locals: list[torch.Tensor]) -> torch.Tensor:
        """Traced, ``reshard_after_forward=N``: the all-gather of the local shards across
        the groups of ``N`` ranks, the piece the forward and the backward re-gather from
        (see [Note: the post-forward piece, compiled])."""
        settings = self.settings
        pending = group_all_gather.start_all_gather(
            self.params, sharded_locals, streams=None, all_gather_comm=settings.all_gather_comm,
            group=settings.post_forward_mesh.across_groups)
        return comm.wait(pending.result.pending)

    @labelled("all_gather")
    def start_all_gather(self) -> PendingUnshard:
        """Starts the group's all-gather (eager), from the post-forward piece when one is
        kept; finish it with :meth:`finish_all_gather`."""
        settings = self.settings
        kept, versions = self._eager.take_piece()
        if (kept is not None and settings.post_forward_mesh is not None
                and versions == self.params.local_versions()):
            return settings.post_forward_mesh.regather(kept, settings.all_gather_comm)
        return group_all_gather.start_all_gather(
            self.params, [p._local_tensor for p in self.params.sharded_params],
            streams=None if settings.unshard_async_op else settings.streams,
            all_gather_comm=settings.all_gather_comm,
        )

    @labelled("all_gather_copy_out")
    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]:
        """Waits for the all-gather and returns the unsharded parameters (post hooks run),
        in the kept storage with ``set_keep_unsharded_storage(True)``."""
        unsharded = group_all_gather.finish_all_gather(pending)
        if self.settings.keep_unsharded_storage:
            return self._eager.kept_storage.refill(unsharded)
        return unsharded

    def _take_prefetched(self, versions: list[tuple[int, int]]) -> PendingUnshard | None:
        """The prefetched all-gather, unless a parameter changed since it was issued
        (``versions``: the parameters' versions now)."""
        pending, issued_versions = self._eager.take_prefetched()
        if pending is not None and issued_versions != versions:
            group_all_gather.complete_all_gather(pending)
            pending = None
        return pending

    # -- forward ------------------------------------------------------------------------

    @labelled("pre_forward")
    def pre_forward(self, module: nn.Module, args: tuple, kwargs: dict, *, bind: bool = True
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
            bind: whether to bind parameters it gathers (``False``: the caller binds
                them, or runs a forward region, which binds its own).

        Returns:
            The (cast) arguments and what :meth:`post_forward` releases.
        """
        if not self.settings.is_root:
            return self._start_forward(module, args, kwargs, bind)
        self._root_state.root_forwards += 1
        try:
            return self._start_forward(module, args, kwargs, bind)
        except BaseException:
            self._root_state.root_forwards -= 1
            raise

    def _start_forward(self, module: nn.Module, args: tuple, kwargs: dict, bind: bool
                       ) -> tuple[tuple, dict, ForwardScope]:
        traced = comm.use_traced_path()
        if not traced:  # see [Note: backward finalization]
            self._root_state.finalization.before_forward()
        if self._hooks_hidden and not traced:  # only an eager backward hides them
            self.restore_post_accumulate_hooks()
        self.params.check_materialized()
        settings = self.settings
        if traced and (settings.explicit_forward_prefetch or settings.explicit_backward_prefetch):
            raise NotImplementedError(
                "set_modules_to_forward_prefetch / set_modules_to_backward_prefetch schedule "
                "eager all-gathers; in a compiled graph Inductor places them "
                "(torch.compile(options=fsdp_traceable.inductor_options(overlap=True))). "
                "Pass [] to both setters before compiling"
            )
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
            return args, kwargs, ForwardScope(None, self._enter_hooks(traced))
        elif self.params.is_bound:
            return args, kwargs, ForwardScope(None, None)
        else:
            reshard = self.settings.reshard_after_forward and torch.is_grad_enabled()
            if traced:
                unsharded = unshard_params(self, recompute_in_backward=reshard)
            else:
                with activation_checkpointing.outside_selective_checkpoint():
                    unsharded = unshard_params(self, recompute_in_backward=False)
            if bind:
                self.params.bind(unsharded)
            else:
                bound = False
        if shared:
            self._set_state(GroupState.LIST_FORWARD, unsharded)
            self._modules_to_run = {id(m) for m in self.modules}
        if not traced:
            if not in_backward():  # see [Note: activation checkpointing]
                for child in module._fsdp_next_groups:
                    if child._state is not GroupState.UNSHARDED:  # else unshard() gathered it
                        child.prefetch()
            if self.settings.reshard_after_forward:
                self._root_state.saved_unsharded.register(self, list(unsharded))
            elif self.params.has_trainable:
                # Its backward reshards them, or keeps them for the next forward; until
                # then forwards reuse them, as FSDP2's unsharded group (after a no_grad
                # forward too, as pipeline stages' shape inference runs one).
                self._eager.keep_forward_unsharded(tuple(unsharded), self.params.local_versions())
        return args, kwargs, ForwardScope(unsharded, self._enter_hooks(traced), bound)

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
        if comm.use_traced_path():
            if bound:
                self.params.unbind()
            return
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group %s after forward: %s", self.log_name,
                      "reshard (backward re-gathers)" if self.settings.reshard_after_forward
                      else "keep the unsharded parameters for backward")
        if not self.settings.reshard_after_forward:
            self.params.unbind()
            return
        with phase("reshard", self.name):
            self._root_state.saved_unsharded.unregister(list(unsharded))
            # Parameters kept after a backward served this forward; like FSDP2, it
            # reshards them now and backward gathers again.
            self._eager.drop_for_backward()
            self.params.unbind()

    def _enter_hooks(self, traced: bool) -> Any:
        """Eager reshard-after-forward: autograd saves tokens for the unsharded parameters."""
        if traced or not self.settings.reshard_after_forward:
            return None
        if activation_checkpointing.in_checkpointed_region():
            return None  # see [Note: activation checkpointing]
        hooks = self._root_state.saved_unsharded.hooks()
        hooks.__enter__()
        return hooks

    # -- backward -------------------------------------------------------------------------

    def take_accumulated_grads(self) -> dict[int, torch.Tensor] | None:
        """Eager no-sync microbatches' gradients (by parameter index), for a compiled
        forward to pass to its backward as inputs; clears them."""
        return self._eager.take_accumulated_grads()

    def pre_backward(self) -> list[torch.Tensor]:
        """Eager: the parameters, re-gathered once for this group's backward (by the
        first saved tensor its backward unpacks), then prefetches per the group's order."""
        if self._eager.unsharded_for_backward is None:
            self._unshard_for_backward()
        return self._eager.unsharded_for_backward

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
        if comm.use_traced_path():
            # Compiled autograd traces the unpack hook of an eager forward's token (see
            # [Note: per-module compile]). One storage per parameter, as eager's: an
            # outlined block backward takes them as inputs, which may not alias.
            self._eager.keep_for_backward(self._traced_regather_for_backward())
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
            return
        versions = self.params.local_versions()
        kept = self._eager.forward_unsharded(versions)
        if kept is not None:  # a group that keeps its forward parameters for backward
            self._eager.keep_for_backward(kept)
        else:
            pending = self._take_prefetched(versions)
            if pending is None:
                pending = self.start_all_gather()
            self._eager.keep_for_backward(self.finish_all_gather(pending))
        if in_backward():
            # Also frees them for a group without trainable parameters, whose
            # backward never reaches post_backward.
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)
        # Prefetch only once this group's all-gather buffer is freed: the peak then
        # holds one in-flight buffer, not two.
        if self.settings.prefetch_backward is not None:
            self.settings.prefetch_backward()

    def _traced_regather_for_backward(self) -> list[torch.Tensor]:
        """Traced by compiled autograd after an eager forward: from the piece that
        forward kept with ``reshard_after_forward=N`` (over the rank's ``N`` ranks, as
        the eager backward), else over the shard group. Each parameter in a buffer of
        its own: the copy-out gives one per parameter in compiled autograd's graph
        (``fresh_outputs_needed`` in :mod:`..collectives.ops`), so no copy per parameter
        is traced for the plain bucket; what an all-gather extension's post hook or the
        kept storage return is copied."""
        kept, _ = self._eager.take_piece()
        mesh = self.settings.post_forward_mesh
        if kept is not None and mesh is not None and kept.hook_inputs is None:
            return mesh.traced_regathered(kept)
        # An all-gather extension's post-all-gather hook needs its metadata from a
        # pre-all-gather call of this trace: gathered again over the shard group.
        pending = group_all_gather.start_all_gather(
            self.params, [p._local_tensor for p in self.params.sharded_params],
            streams=None, all_gather_comm=self.settings.all_gather_comm)
        unsharded = self.finish_all_gather(pending)
        if pending.hook_inputs is not None or self.settings.keep_unsharded_storage:
            return [t.clone() for t in unsharded]
        return unsharded

    def _end_backward(self) -> None:
        if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
            log.debug("group %s after backward: %s", self.log_name,
                      "reshard" if self.settings.reshard_after_backward
                      else "keep the unsharded parameters for the next forward")
        if self.settings.reshard_after_backward:
            with phase("reshard", self.name):
                self._eager.drop_for_backward()

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
        if not comm.use_traced_path():  # see [Note: backward finalization]
            self._root_state.finalization.note_backward()
        self._eager.end_backward(self.settings.reshard_after_backward)
        if not accumulated:
            accumulated = self._eager.take_accumulated_grads()
        grads = gradients_to_reduce(self.params, self.settings, unsharded_grads, accumulated)
        sharded_grads: list[torch.Tensor | None] = [None] * len(self.params.sharded_params)
        if not self.settings.requires_gradient_sync:
            self._eager.keep_accumulated_grads(grads)
            return sharded_grads
        if not grads:
            return sharded_grads
        indices = sorted(grads)
        pending = start_reduce(self.params, self.settings, grads, indices,
                               self._eager.take_partial_reduce_output(), name=self.name)
        if not comm.use_traced_path():
            # Eager, as FSDP2: the reduce-scatter runs while autograd computes the next
            # groups' gradients; the gradients reach .grad when it is finished (by the
            # next group's reduction or at the end of backward), not through autograd.
            self._root_state.reduce_queue.put(
                pending, GradientTarget(self.params.sharded_params, indices,
                                        self._eager.keep_partial_reduce_output))
            return sharded_grads
        result = finish_foreach_reduce(pending)
        for i, grad in zip(indices, result.sharded_grads):
            sharded_grads[i] = grad
        return sharded_grads

    # -- backward finalization (see [Note: backward finalization]) ------------------------

    @property
    def root_state(self) -> RootState:
        """What the model shares between its groups (see [Note: per-model state])."""
        return self._root_state

    @property
    def has_accumulated_grads(self) -> bool:
        """Whether eager no-sync backwards left unsharded gradients to reduce."""
        return self._eager.has_accumulated_grads

    @property
    def has_partial_reduce_output(self) -> bool:
        """HSDP: whether backwards without the all-reduce left reduce-scatter output."""
        return self._eager.has_partial_reduce_output

    @property
    def holds_unsharded(self) -> bool:
        """Whether the group holds its unsharded parameters (FSDP2's
        ``FSDPParamGroup.is_unsharded``): gathered by ``unshard()`` or a forward and not
        resharded yet, or kept past a backward (``reshard_after_forward=False``,
        ``reshard_after_backward=False``); not the piece ``reshard_after_forward=N`` keeps."""
        return (self._state is not GroupState.SHARDED or self.params.is_bound
                or self._eager.holds_unsharded)

    def drop_kept_storage(self) -> None:
        """Frees the storage ``set_keep_unsharded_storage(True)`` kept."""
        self._eager.kept_storage.drop()

    def post_backward_outside_backward(self) -> None:
        """Eager, outside a backward pass: FSDP2's ``FSDPParamGroup.post_backward()``, which
        torch's pipeline stages call after their microbatches' no-sync backwards (see
        [Note: pipeline schedules]).

        With gradient sync on, the gradients accumulated so far are reduce-scattered (the
        model's reduce queue finishes them); with ``reshard_after_backward``, the
        parameters kept for backward are freed. A group with nothing accumulated reduces
        nothing, so a second call is a no-op.
        """
        if self._eager.has_accumulated_grads and self.settings.requires_gradient_sync:
            self.post_backward((None,) * len(self.params.sharded_params))
        elif self.settings.reshard_after_backward:
            self._eager.end_backward(reshard_after_backward=True)

    def hide_post_accumulate_hooks(self) -> None:
        """Eager backward: autograd must not run the parameters' post-accumulate-grad
        hooks; the reduction does (see [Note: post-accumulate-grad hooks in eager backward])."""
        if post_accumulate_hooks.hide(self.params.sharded_params):
            self._hooks_hidden = True

    def restore_post_accumulate_hooks(self) -> None:
        """Puts back what :meth:`hide_post_accumulate_hooks` took (none ran meanwhile)."""
        self._hooks_hidden = False
        for param in self.params.sharded_params:
            post_accumulate_hooks.restore(param)

    def finish_reductions(self) -> None:
        """Finishes the model's eager gradient reductions in flight (writing ``.grad``),
        as FSDP2's root post-backward callback waits for its reduce-scatters."""
        self._root_state.reduce_queue.finish_all()
