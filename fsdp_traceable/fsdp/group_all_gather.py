"""The all-gather half of a parameter group: gathering its parameters (traced or eager,
with or without all-gather extensions) and the eager state around it (prefetches, the
post-forward piece, parameters kept between forward and backward).

:class:`~.param_group.ParamGroup` adds the life cycle that decides when to gather.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..collectives import comm, foreach_all_gather, foreach_all_gather_copy_out
from ..profiler_labels import phase
from .all_gather_extensions import PendingUnshard, all_gather_inputs, unsharded_from_outputs
from .eager_state import EagerState
from .sharded_group import ShardedGroup
from .sharded_params import pinned

log = logging.getLogger(__name__)


class GatheringGroup(ShardedGroup):
    """A :class:`~.sharded_group.ShardedGroup` that gathers its parameters.

    Its eager state (an :class:`EagerState`) holds what an all-gather issued early, or
    kept from an earlier one, leaves for the next use.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Eager-only state between calls (prefetch, parameters kept for backward,
        # no-sync gradient accumulation).
        self._eager = EagerState()
        # Whether no parameter is on meta (checked before the first all-gather, and
        # again after the parameters are re-read).
        self._materialized = False

    @property
    def has_prefetch(self) -> bool:
        """Whether an eager all-gather issued ahead of its use is in flight."""
        return self._eager.prefetched is not None

    def refresh_params(self) -> None:
        """Re-reads the sharded parameters from their modules (after ``module._apply``,
        e.g. ``to_empty``, may have replaced them) and re-pins offloaded shards."""
        for owner, name, index in self.bindings:
            param = owner._parameters[name]
            if self.pin_memory and not param._local_tensor.is_pinned():
                # As FSDP2: shards materialized on the device (to_empty(device="cuda"))
                # go back to host memory.
                param._local_tensor = pinned(param._local_tensor.cpu())
            self.sharded_params[index] = param
        _ = self.extensions  # malformed hooks of the new local tensors raise now
        self._eager.reset()
        self._materialized = False

    def prefetch(self) -> None:
        """Eager: issues this group's all-gather now, to overlap the compute before it."""
        if not self.sharded_params or self.compiled_on_its_own():
            return
        self._check_materialized()
        if self._eager.prefetched is None and self._eager.unsharded_for_backward is None:
            if log.isEnabledFor(logging.DEBUG):
                log.debug("prefetch: all-gather of group %r issued early", self.name)
            self._eager.keep_prefetched(self.start_all_gather(), self._local_versions())

    def compiled_on_its_own(self) -> bool:
        """Whether a module of the group was compiled by itself (``module.compile()``, as
        per-block compile does): its graph gathers the parameters, so an eager prefetch
        from the module before it would never be used."""
        return any(getattr(m, "_compiled_call_impl", None) is not None for m in self.modules)

    def all_gather(self, sharded_locals: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """The unsharded parameters (``param_dtype``), from a prefetch when one is in flight.

        Called by the group's autograd bridge (``UnshardParams``) with the sharded
        local tensors it differentiates through.
        """
        if comm.use_traced_path():
            return self.finish_all_gather(self._start_all_gather(list(sharded_locals), None))
        if self._eager.unsharded_for_backward is not None:
            # Kept by a backward with reshard_after_backward=False: like FSDP2, the
            # next forward uses them whatever the flag says now.
            return self._eager.unsharded_for_backward
        kept = self._eager.forward_unsharded(self._local_versions())
        if kept is not None:
            # Gathered by an earlier forward of this group, which does not reshard after
            # forward, and not resharded by a backward since: like FSDP2, still unsharded.
            return kept
        pending = self._take_prefetched()
        if pending is None:
            pending = self.start_all_gather()
        unsharded = self.finish_all_gather(pending)
        if self.post_forward_mesh is not None:
            # FSDP2 keeps this piece from the forward's end until the next all-gather;
            # it is taken now, while the all-gather output is alive.
            self._eager.keep_piece(self.post_forward_mesh.keep(pending), self._local_versions())
        return unsharded

    def start_all_gather(self) -> PendingUnshard:
        """Starts the group's all-gather (eager), from the post-forward piece when one is
        kept; finish it with :meth:`finish_all_gather`."""
        with phase("all_gather", self.name):
            kept, versions = self._eager.take_piece()
            if (kept is not None and self.post_forward_mesh is not None
                    and versions == self._local_versions()):
                return self.post_forward_mesh.regather(kept, self.all_gather_comm)
            return self._start_all_gather(
                [p._local_tensor for p in self.sharded_params], streams=self.streams
            )

    def _start_all_gather(
        self, sharded_locals: list[torch.Tensor], streams: comm.DeviceStreams | None
    ) -> PendingUnshard:
        sharded_locals = self._on_device(sharded_locals)
        # Traced too: Dynamo guards on the hooks it finds, so hooks set later recompile.
        extensions = self.extensions
        if all(extension is None for extension in extensions):
            result = foreach_all_gather(sharded_locals, self.infos, self.shard_group,
                                        streams=streams, all_gather_comm=self.all_gather_comm,
                                        check=False)
            return PendingUnshard(result, None)
        hook_inputs = all_gather_inputs(sharded_locals, self.infos, extensions)
        result = foreach_all_gather(hook_inputs.tensors, hook_inputs.infos, self.shard_group,
                                    streams=streams, all_gather_comm=self.all_gather_comm)
        return PendingUnshard(result, hook_inputs)

    def _check_materialized(self) -> None:
        """Raises FSDP2's error if a parameter is still on meta: before the group's first
        all-gather (forward, ``unshard()`` or a prefetch), outside its autograd bridge.

        Eagerly the answer is kept until the parameters change. A traced forward does
        not check: reading the flag there would add a guard (and writing it, a
        recompile), and reading the parameters through the group lets ``dynamic=True``
        make their shapes symbolic."""
        if torch.compiler.is_compiling():
            return
        if not self._materialized:
            self._raise_if_on_meta()
            self._materialized = True

    def _raise_if_on_meta(self) -> None:
        on_meta = [fqn for fqn, p in zip(self.fqns, self.sharded_params) if p.is_meta]
        if on_meta:
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {on_meta}\nFor example, call "
                "module.to_empty(device) to materialize to device and call "
                "module.reset_parameters() on each module to initialize values."
            )

    def finish_all_gather(self, pending: PendingUnshard) -> list[torch.Tensor]:
        """Waits for the all-gather and returns the unsharded parameters (post hooks run)."""
        with phase("all_gather_copy_out", self.name):
            outputs = foreach_all_gather_copy_out(pending.result)
            if pending.hook_inputs is None:
                return outputs
            return unsharded_from_outputs(outputs, pending.hook_inputs)

    def _take_prefetched(self) -> PendingUnshard | None:
        """The prefetched all-gather, unless a parameter changed since it was issued."""
        pending, versions = self._eager.take_prefetched()
        if pending is not None and versions != self._local_versions():
            foreach_all_gather_copy_out(pending.result)  # complete the collective every rank joined
            pending = None
        return pending

    def _drop_prefetched(self) -> None:
        """Completes a prefetched all-gather (every rank joined it) and drops its output."""
        pending, _ = self._eager.take_prefetched()
        if pending is not None:
            foreach_all_gather_copy_out(pending.result)
