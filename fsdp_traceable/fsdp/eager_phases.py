"""A parameter group's eager path: the steps of its life cycle that only run eagerly,
with c10d collectives in flight between calls.

``ParamGroup`` runs each phase (pre/post forward, pre/post backward) once for both
paths and asks :class:`EagerPath` or :class:`~.traced_phases.TracedPath`, picked once per
call (see [Note: the traced/eager seam]), for the steps that differ. The eager ones:
the prefetch of an all-gather ahead of its use, the unsharded parameters kept between
forward and backward (:class:`~.eager_state.EagerState`, and the saved-tensor tokens of
:mod:`.saved_unsharded`), the gradient reductions left in flight on the model's
:mod:`.reduce_queue`, and the post-accumulate-grad hooks hidden from autograd while
they are (:mod:`.post_accumulate_hooks`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from ..collectives.reduce import PendingReduce
from ..profiler_labels import labelled, phase
from ..tracing import in_backward
from . import activation_checkpointing, group_all_gather, post_accumulate_hooks
from .autograd_bridge import UnshardingGroup, unshard_params
from .eager_state import EagerState, Versions
from .features.all_gather_extensions import PendingUnshard
from .group_state import GroupState
from .reduce_queue import GradientTarget
from .saved_unsharded import Regathered

if TYPE_CHECKING:
    from .root_state import RootState

log = logging.getLogger(__name__)


class EagerGroup(UnshardingGroup, Protocol):
    """What the eager path reads of its group (``ParamGroup``) besides its parameters
    and settings."""

    @property
    def name(self) -> str: ...

    @property
    def log_name(self) -> str: ...

    @property
    def root_state(self) -> RootState: ...

    def compiled_on_its_own(self) -> bool: ...

    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]: ...

    def pre_backward(self) -> list[torch.Tensor]: ...

    def end_backward(self) -> None: ...


class EagerPath:
    """The eager steps of one group's life cycle (see the module docstring).

    Args:
        group: the group.
        state: its eager state, which it shares with the traced path (a backward
            compiled autograd traces after an eager forward reads it).
    """

    def __init__(self, group: EagerGroup, state: EagerState) -> None:
        self._group = group
        self._state = state
        # Whether a backward hid post-accumulate-grad hooks not yet restored.
        self._hooks_hidden = False
        # The tokens of the group's latest resharding forward (see [Note: the re-gather
        # at the backward's start]).
        self._forward_tokens: Regathered | None = None

    @property
    def name(self) -> str:
        """The group's name, for the profiler labels."""
        return self._group.name

    # -- unshard ahead of use -------------------------------------------------------------

    def unshard_ahead(self) -> bool:
        """``unshard(async_op=True)``: issues the all-gather as a prefetch; the next
        forward or ``wait_for_unshard`` finishes it. Returns True: one is in flight."""
        self.prefetch()
        return True

    def prefetch(self) -> None:
        """Issues the group's all-gather now, to overlap the compute before it."""
        group, state = self._group, self._state
        if not group.params.sharded_params or group.compiled_on_its_own():
            return
        group.params.check_materialized()
        if state.holds_forward_unsharded(group.params.local_versions):
            return  # still unsharded from a forward that keeps them, as FSDP2's group
        if state.prefetched is None and state.unsharded_for_backward is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefetch: all-gather of group %s issued early", group.log_name)
            state.keep_prefetched(self.start_all_gather(), group.params.local_versions())
            if in_backward():
                # As FSDP2's finalize_backward: a backward prefetch this backward did not
                # use (its module's backward read no parameter) is waited for at the
                # backward's end, not carried, buffer and all, into the next step.
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_prefetch)

    def finish_prefetch(self) -> None:
        """Waits for the prefetched all-gather, if one is in flight, and drops it unused."""
        group_all_gather.complete_all_gather(self._state.take_prefetched()[0])

    def _take_prefetched(self, versions: Versions) -> PendingUnshard | None:
        """The prefetched all-gather, unless a parameter changed since it was issued
        (``versions``: the parameters' versions now)."""
        pending, issued_versions = self._state.take_prefetched()
        if pending is not None and issued_versions != versions:
            group_all_gather.complete_all_gather(pending)
            pending = None
        return pending

    @labelled("all_gather")
    def start_all_gather(self) -> PendingUnshard:
        """Starts the group's all-gather, from the post-forward piece when one is kept."""
        params, settings = self._group.params, self._group.settings
        kept, versions = self._state.take_piece()
        if (kept is not None and settings.post_forward_mesh is not None
                and versions == params.local_versions()):
            return settings.post_forward_mesh.regather(kept, settings.all_gather_comm)
        return group_all_gather.start_all_gather(
            params, [p._local_tensor for p in params.sharded_params],
            streams=None if settings.unshard_async_op else settings.streams,
            all_gather_comm=settings.all_gather_comm,
        )

    def _start_or_take_prefetched(self, versions: Versions) -> PendingUnshard:
        """The prefetched all-gather when it is still current, else a new one."""
        pending = self._take_prefetched(versions)
        return self.start_all_gather() if pending is None else pending

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...],
                   kept_piece: torch.Tensor | None) -> list[torch.Tensor]:
        """``ParamGroup.all_gather``: the parameters kept from a backward or an earlier
        forward, else the prefetched all-gather, else a new one (the group's own
        parameters; ``UnshardParams`` differentiates through ``sharded_locals``)."""
        state = self._state
        if state.unsharded_for_backward is not None:
            # Kept by a backward with reshard_after_backward=False: like FSDP2, the
            # next forward uses them whatever the flag says now.
            return state.unsharded_for_backward
        versions = self._group.params.local_versions()
        kept = state.forward_unsharded(versions)
        if kept is not None:
            # Gathered by an earlier forward of this group, which does not reshard after
            # forward, and not resharded by a backward since: like FSDP2, still unsharded.
            return kept
        pending = self._start_or_take_prefetched(versions)
        unsharded = self._group.finish_all_gather(pending)
        post_forward_mesh = self._group.settings.post_forward_mesh
        if post_forward_mesh is not None:
            # FSDP2 keeps this piece from the forward's end until the next all-gather;
            # it is taken now, while the all-gather output is alive.
            state.keep_piece(post_forward_mesh.keep(pending), versions)
        return unsharded

    # -- forward ------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """Before the forward: a backward's finalization, and the hooks it hid."""
        self._group.root_state.finalization.before_forward()  # see [Note: backward finalization]
        if self._hooks_hidden:
            self.restore_post_accumulate_hooks()

    def gather_for_forward(self, reshard: bool) -> tuple[torch.Tensor, ...]:
        """The forward's unsharded parameters (autograd saves tokens for them when the
        group reshards, :meth:`saved_tensor_hooks`, so ``reshard`` changes nothing here)."""
        with activation_checkpointing.outside_selective_checkpoint():
            return unshard_params(self._group, recompute_in_backward=False)

    def after_forward_gather(self, module: nn.Module, unsharded: tuple[torch.Tensor, ...]
                             ) -> None:
        """Prefetches the groups after ``module``'s, and registers the unsharded
        parameters for the saved-tensor tokens (resharding) or keeps them (not)."""
        group = self._group
        if not in_backward():  # see [Note: activation checkpointing]
            for child in module._fsdp_next_groups:
                if child.state is not GroupState.UNSHARDED:  # else unshard() gathered it
                    child.prefetch()
        if group.settings.reshard_after_forward:
            self._forward_tokens = group.root_state.saved_unsharded.register(
                group, list(unsharded))
        elif group.params.has_trainable:
            # Its backward reshards them, or keeps them for the next forward; until
            # then forwards reuse them, as FSDP2's unsharded group (after a no_grad
            # forward too, as pipeline stages' shape inference runs one).
            self._state.keep_forward_unsharded(tuple(unsharded), group.params.local_versions())

    def saved_tensor_hooks(self) -> Any:
        """Reshard-after-forward: the entered hooks through which autograd saves tokens
        for the unsharded parameters (``None`` if none)."""
        if not self._group.settings.reshard_after_forward:
            return None
        if activation_checkpointing.in_checkpointed_region():
            return None  # see [Note: activation checkpointing]
        hooks = self._group.root_state.saved_unsharded.hooks()
        hooks.__enter__()
        return hooks

    def hook_backward_start(self, output: Any) -> None:
        """Re-gathers at the start of the group's backward, as FSDP2's pre-backward,
        where no saved token will.

        [Note: the re-gather at the backward's start]
        A group that reshards after forward re-gathers when its backward reads a
        parameter (a saved token's unpack). FSDP2 all-gathers a resharded group when
        the gradient of its forward's output arrives, whatever its backward then
        reads, and ours issues the collectives it issues: where the forward saved no
        token (a first layer whose input needs no gradient, an embedding, a
        checkpointed forward), the outputs that require grad get a tensor hook that
        re-gathers. Where it saved one, the unpack re-gathers, once, as the hook would
        have (a little later: at the first backward op that reads a parameter), and
        compiled autograd, which traces every hook of a backward it captures, has no
        hook to trace per block. A compiled-autograd backward traces the hook to
        nothing: its graph gathers where a parameter is read.
        """
        group = self._group
        if (not group.params.sharded_params or not group.settings.reshard_after_forward
                or not group.settings.unshard_in_backward or not torch.is_grad_enabled()
                or in_backward()):
            return
        if self._forward_tokens is not None and self._forward_tokens.saved:
            return
        for tensor in pytree.tree_leaves(output):
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                tensor.register_hook(self._regather_at_backward_start)

    def _regather_at_backward_start(self, grad: torch.Tensor) -> None:
        if not torch.compiler.is_compiling():
            self._group.pre_backward()

    def release(self, unsharded: tuple[torch.Tensor, ...], bound: bool) -> None:
        """After the forward: reshards, or keeps the parameters for backward."""
        group = self._group
        settings = group.settings
        if log.isEnabledFor(logging.DEBUG):
            log.debug("group %s after forward: %s", group.log_name,
                      "reshard (backward re-gathers)" if settings.reshard_after_forward
                      else "keep the unsharded parameters for backward")
        if not settings.reshard_after_forward:
            group.params.unbind()
            return
        with phase("reshard", group.name):
            group.root_state.saved_unsharded.unregister(list(unsharded))
            # Parameters kept after a backward served this forward; like FSDP2, it
            # reshards them now and backward gathers again.
            self._state.drop_for_backward()
            group.params.unbind()

    # -- backward -------------------------------------------------------------------------

    def gather_for_backward(self) -> None:
        """Keeps the parameters for the group's backward: those its forward kept, else
        the prefetch, else a new all-gather; then prefetches per the group's order."""
        group, state = self._group, self._state
        versions = group.params.local_versions()
        kept = state.forward_unsharded(versions)
        if kept is not None:  # a group that keeps its forward parameters for backward
            state.keep_for_backward(kept)
        else:
            pending = self._start_or_take_prefetched(versions)
            state.keep_for_backward(group.finish_all_gather(pending))
        if in_backward():
            # Also frees them for a group without trainable parameters, whose
            # backward never reaches post_backward.
            torch.autograd.Variable._execution_engine.queue_callback(group.end_backward)
        # Prefetch only once this group's all-gather buffer is freed: the peak then
        # holds one in-flight buffer, not two.
        if group.settings.prefetch_backward is not None:
            group.settings.prefetch_backward()

    def begin_post_backward(self) -> None:
        """Before the reduction: the backward counts for its finalization."""
        self._group.root_state.finalization.note_backward()  # see [Note: backward finalization]

    def finish_reduce(self, pending: PendingReduce, indices: list[int],
                      sharded_grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Leaves the started reduction on the model's queue and returns
        ``sharded_grads`` as they are (all ``None``).

        As FSDP2: the reduce-scatter runs while autograd computes the next groups'
        gradients; they reach ``.grad`` when it is finished (by the next group's
        reduction or at the end of backward), not through autograd."""
        group = self._group
        group.root_state.reduce_queue.put(
            pending, GradientTarget(group.params.sharded_params, indices,
                                    self._state.keep_partial_reduce_output))
        return sharded_grads

    def hide_post_accumulate_hooks(self) -> None:
        """Autograd must not run the parameters' post-accumulate-grad hooks; the
        reduction does (see [Note: post-accumulate-grad hooks in eager backward])."""
        if post_accumulate_hooks.hide(self._group.params.sharded_params):
            self._hooks_hidden = True

    def restore_post_accumulate_hooks(self) -> None:
        """Puts back what :meth:`hide_post_accumulate_hooks` took (none ran meanwhile)."""
        self._hooks_hidden = False
        for param in self._group.params.sharded_params:
            post_accumulate_hooks.restore(param)
