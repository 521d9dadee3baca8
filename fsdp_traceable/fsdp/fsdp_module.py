"""``FSDPModule``: every method a ``fully_shard``-ed module gains (the class swap that
makes a module one is :mod:`.class_swap`).

The setters change the parameter groups' settings through ``ParamGroup.configure``
(see [Note: group settings]); everything else calls the group's life-cycle methods
(:mod:`.param_group`). The setters' argument checks are :mod:`.setting_checks`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle
from torch.utils.hooks import RemovableHandle
from typing_extensions import deprecated

from ..collectives import comm
from . import backward_finalization, block_backward, forward_regions, traced_step_passes
from .backward_finalization import GradientReductionHandle
from .features import module_compile
from .forward_hooks import ForwardScope
from .module_state import FSDPModuleState, entry_of, is_sharded, state_of
from .param_group import ParamGroup
from .setting_checks import (
    check_bool,
    check_comm,
    check_fsdp_modules,
    check_no_custom_comm,
    check_no_sync_eager,
    fsdp2_comms,
    prefetch_all,
)

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

log = logging.getLogger(__name__)


class FSDPModule(TorchFSDPModule):
    """Mixin added to every module passed to :func:`fully_shard`.

    A subclass of torch's ``FSDPModule``, so ``isinstance`` checks written for FSDP2
    (and ``register_fsdp_forward_method``) accept it; every torch method that would
    reach FSDP2's internal state is overridden here, by an implementation or by a
    clear ``NotImplementedError``.
    """

    # MRO: [FSDP<Orig>, this, torch's FSDPModule, Orig, ...]; torch's __new__ builds Orig.
    _orig_cls_mro_index: int = 3

    # What one fully_shard call built, read from its state (FSDPModuleState), the one
    # place fully_shard writes it.
    @property
    def _fsdp_group(self) -> ParamGroup:
        return state_of(self).group

    @property
    def _fsdp_next_groups(self) -> list[ParamGroup]:
        return state_of(self).next_groups

    # -- unsharding ------------------------------------------------------------------

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gathers this module's parameters now (not recursive), as FSDP2's ``unshard``.

        The next forward of the module uses them and then reshards per
        ``reshard_after_forward``; :meth:`reshard` drops them earlier.

        Args:
            async_op: return a handle whose ``wait()`` finishes the unshard (the next
                forward also waits for it), instead of waiting here.

        Returns:
            An ``UnshardHandle`` if ``async_op``, else ``None``.
        """
        check_bool("async_op", async_op)
        group = self._fsdp_group
        in_flight = group.unshard(async_op)
        return _UnshardHandle(group if in_flight else None) if async_op else None

    def reshard(self) -> None:
        """Frees the unsharded parameters of this module's group (not recursive)."""
        self._fsdp_group.reshard()

    # -- iteration state and backward finalization (see [Note: backward finalization]) ----

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward, on the root: reshards every
        group, waits for the gradient reductions in flight and drops them, and forgets
        the iteration (no-sync and HSDP partial gradients, an open ``fully_shard([a,
        b])`` pass, the finalization mode; an outstanding ``finalize_backward`` handle's
        ``wait()`` then raises). Where torch's FSDP2 has manual backward finalization
        (2.15 on) it also clears the sharded gradients, as FSDP2's does there.

        Raises:
            RuntimeError: not the root module.
        """
        backward_finalization.reset(self._fsdp_group, self._distinct_groups())

    def set_manual_backward_finalization(self, enabled: bool) -> None:
        """On the root: whether the caller ends each backward iteration with
        :meth:`finalize_backward` (reductions stay in flight until then), instead of
        each backward pass ending itself. FSDP2's meaning (torch 2.15).

        Args:
            enabled: ``True`` before forward, for the iterations the caller finalizes.

        Raises:
            RuntimeError: not the root module, or a change of mode during backward or
                after a backward started and before its finalization.
        """
        check_bool("enabled", enabled)
        if not self._fsdp_group.settings.is_root:
            raise RuntimeError("set_manual_backward_finalization must be called on the root FSDP module")
        self._fsdp_group.root_state.finalization.set_manual(enabled)

    def finalize_backward(self, *, async_op: bool = False) -> GradientReductionHandle | None:
        """On the root, in manual backward finalization, after the iteration's backward
        passes: reduces the no-sync gradients of groups whose gradient sync is on now,
        frees parameters kept for backward where ``reshard_after_backward`` is on, and
        finishes every gradient reduction (writing ``.grad``). A no-op before the first
        forward. FSDP2's meaning (torch 2.15); eager only.

        Args:
            async_op: start the reductions and return a handle whose ``wait()`` finishes
                them; a forward or another finalization before it raises.

        Returns:
            A ``GradientReductionHandle`` (torch's class where it has one) if
            ``async_op``, else ``None``.

        Raises:
            RuntimeError: FSDP2's misuse errors (not the root, manual mode off, during
                backward, a previous handle not waited for, HSDP partial reductions).
            NotImplementedError: called inside a compiled function.
        """
        check_bool("async_op", async_op)
        return backward_finalization.finalize(self._fsdp_group, self._distinct_groups(), async_op)

    def set_keep_unsharded_storage(self, keep: bool, *, recurse: bool = True) -> None:
        """Eager, as FSDP2: whether each parameter's unsharded storage outlives reshard,
        so its data pointer stays the same across reshard and unshard (CUDA graph
        capture), at the cost of holding it (and one copy per all-gather into it). The
        numbers do not change. A compiled graph allocates its own: it raises while on.

        Args:
            keep: whether to keep the unsharded storage.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        self._set_group_flag("keep_unsharded_storage", keep, recurse)
        if not keep:
            for group in self._groups(recurse):
                group.drop_kept_storage()

    def _distinct_groups(self) -> list[ParamGroup]:
        """Every group under this module once, in module pre-order."""
        return list({id(g): g for g in self._groups(recurse=True)}.values())

    # -- per-group flags ----------------------------------------------------------------

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether backward reduce-scatters gradients (``False`` accumulates them unsharded).

        Args:
            requires_gradient_sync: ``False`` for all but the last microbatch.
            recurse: apply to every ``fully_shard``-ed submodule too.

        Raises:
            NotImplementedError: ``False`` while a module of a group was compiled by
                itself (``module.compile()``): its compiled backward reduce-scatters on
                every backward and cannot keep unsharded gradients.
        """
        check_bool("requires_gradient_sync", requires_gradient_sync)
        if not requires_gradient_sync:
            check_no_sync_eager(self._groups(recurse))
        self._set_group_flag("requires_gradient_sync", requires_gradient_sync, recurse,
                             also=("requires_all_reduce",))

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the parameters re-gathered for backward once it finishes.

        Args:
            reshard_after_backward: ``False`` keeps them for the next forward, which then
                skips its all-gather (use only while the parameters do not change).
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        self._set_group_flag("reshard_after_backward", reshard_after_backward, recurse)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether backward re-gathers the parameters instead of keeping them from forward.

        Overrides the default (``True`` except for the root), as in FSDP2: ``True``
        on the root makes its backward re-gather too.

        Args:
            reshard_after_forward: free the unsharded parameters after forward.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        self._set_group_flag("reshard_after_forward", reshard_after_forward, recurse)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: whether backward all-reduces the reduce-scattered gradients.

        ``False`` keeps the reduce-scatter output and adds the next backward's to it (no
        gradient is written until a backward all-reduces): accumulation with only
        intra-replica communication. Without HSDP it changes nothing, as in FSDP2.

        Args:
            requires_all_reduce: ``False`` for all but the last microbatch.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        self._set_group_flag("requires_all_reduce", requires_all_reduce, recurse)

    def set_reduce_scatter_unused_params(
        self, reduce_scatter_unused_params: bool, *, recurse: bool = True
    ) -> None:
        """Whether parameters that got no gradient join the reduce-scatter with zeros.

        Needed when ranks use different parameters (conditional control flow), so every
        rank issues the same reduce-scatter; those parameters then get a gradient.

        Args:
            reduce_scatter_unused_params: ``True`` to reduce zeros for unused parameters.
            recurse: apply to every ``fully_shard``-ed submodule too.
        """
        self._set_group_flag("reduce_scatter_unused_params", reduce_scatter_unused_params,
                             recurse)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2 compatibility: backward leaves no reduction pending to wait for."""
        check_bool("is_last_backward", is_last_backward)

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this module's backward may all-gather its parameters.

        Our backward all-gathers a group only when its backward reads the parameters, so
        ``False`` removes no all-gather FSDP2 would skip; it turns a backward that does
        read them into a clear error (FSDP2 would compute with the sharded parameters).

        Args:
            unshard_in_backward: ``False`` for modules whose backward needs no parameters.
        """
        self._set_group_flag("unshard_in_backward", unshard_in_backward, recurse=False)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """FSDP2's: whether the pre-forward and pre-backward unshards of every group under
        this module run their copy-in on the current stream (``True``: allocations stay
        in that stream; overlap then comes from explicit prefetching) instead of the
        copy-in stream. The all-gather itself is asynchronous either way; no stream
        exists on CPU, where nothing changes. Numbers are the same.

        Args:
            async_op: ``True`` for the current stream.
        """
        check_bool("async_op", async_op)
        for group in self._groups(recurse=True):
            group.configure(unshard_async_op=async_op)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Whether this module's collectives reduce with ``sum`` only (divides done apart).

        Args:
            enable: ``True`` for sum-only collectives and explicit divides.
        """
        check_bool("enable", enable)
        self._fsdp_group.configure(force_sum_reduction=enable)

    # -- gradient reduction -------------------------------------------------------------

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divides this module's reduced gradients by ``factor`` instead of the data-parallel size.

        FSDP2 multiplies by ``1/factor`` inside the reduce-scatter (NCCL's ``premul_sum``);
        gloo and functional collectives lack that op, so ours sums and divides the
        reduce-scatter output (FSDP2's own numerics under
        ``set_force_sum_reduction_for_comms(True)``). A factor equal to the shard size
        averages in the collective, as FSDP2 does.

        Args:
            factor: a positive number.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"factor must be a positive number, got {factor!r}")
        self._fsdp_group.configure(gradient_divide_factor=float(factor))

    @deprecated("Use `set_gradient_divide_factor` instead")
    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Use :meth:`set_gradient_divide_factor` instead."""
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(
        self,
        hook: Callable[[torch.Tensor], None],
        *,
        stream: torch.cuda.Stream | None = None,
    ) -> None:
        """Calls ``hook(reduce_output)`` on this module's reduced gradient bucket.

        ``reduce_output`` is the flat reduce-scatter output (the HSDP all-reduce output
        with HSDP), before it is split into the sharded gradients; the hook may change it
        in place (e.g. a custom all-reduce across another mesh dimension).

        Args:
            hook: ``hook(reduce_output) -> None``.
            stream: a stream to run the hook in (eager, non-HSDP only, as FSDP2).
        """
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        group = self._fsdp_group
        if stream is not None and group.params.is_hsdp:
            raise ValueError("stream cannot be set when using native HSDP")
        group.configure(all_reduce_hook=hook, all_reduce_hook_stream=stream)

    # -- prefetching and streams ----------------------------------------------------------

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Eager: after this module's all-gather, issue the all-gathers of ``modules``.

        Replaces the default (the next group in forward order). A compiled forward's
        all-gathers are placed by Inductor, so a non-empty list raises there.

        Args:
            modules: ``fully_shard``-ed modules, typically the next one or two blocks.
        """
        state_of(self).next_groups = [m._fsdp_group for m in check_fsdp_modules(modules, FSDPModule)]
        self._fsdp_group.configure(explicit_forward_prefetch=bool(modules))
        _log_prefetch("forward", self._fsdp_group, self._fsdp_next_groups)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Eager: after this module's backward all-gather, issue the all-gathers of ``modules``.

        Replaces the default (the previous group in forward order). Raises under a
        compiled backward when non-empty, as the forward setter does.

        Args:
            modules: ``fully_shard``-ed modules, typically the previous one or two blocks.
        """
        groups = [m._fsdp_group for m in check_fsdp_modules(modules, FSDPModule)]
        group = self._fsdp_group
        group.configure(prefetch_backward=prefetch_all(groups) if groups else None,
                        explicit_backward_prefetch=bool(modules))
        _log_prefetch("backward", group, groups)

    def set_post_optim_event(self, event: torch.Event) -> None:
        """Eager: the next all-gather copy-in of every group under this module waits on
        ``event`` (recorded after the optimizer step) instead of on the whole current
        stream; the event is used once, so set a new one each iteration.

        A compiled graph runs its all-gathers on the current stream, after the optimizer
        step that stream already ordered, so there the event has nothing to add.

        Args:
            event: an event recorded after ``optimizer.step()``.
        """
        for group in self._groups(recurse=True):
            group.set_post_optim_event(event)

    # -- custom comms -----------------------------------------------------------------

    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Eager: this module's all-gathers allocate their output with ``comm.allocate``
        and run ``comm(output, input, group, async_op=True)`` (FSDP2's ``AllGather``).

        A compiled graph all-gathers with functional collectives: it raises while set.

        Args:
            comm: an FSDP2 ``AllGather`` (``allocate`` and ``__call__``).
        """
        self._fsdp_group.configure(all_gather_comm=check_comm(comm, "comm"))

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Eager: this module's reduce-scatters allocate their input and output with
        ``comm.allocate`` and run ``comm(output, input, group, op, async_op=True)``
        (FSDP2's ``ReduceScatter``); the copy-in's result is copied into the input.

        A compiled backward reduces with functional collectives: it raises while set.

        Args:
            comm: an FSDP2 ``ReduceScatter`` (``allocate`` and ``__call__``).
        """
        self._fsdp_group.configure(reduce_scatter_comm=check_comm(comm, "comm"))

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Eager, as FSDP2: this module's all-gather and reduce-scatter buffers come from the
        process group's allocator where its backend has one (NCCL's memory pool), else from
        ``torch.empty``; through FSDP2's own ``ProcessGroupAlloc*`` comms, so the collectives
        and numbers are FSDP2's. A compiled graph allocates its own buffers: it raises while
        on.

        Args:
            enable: whether to allocate from the process group.
        """
        check_bool("enable", enable)
        all_gather_comm, reduce_scatter_comm = fsdp2_comms(
            "ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter")
        groups = self._groups(recurse=False)
        check_no_custom_comm(groups, "set_allocate_memory_from_process_group_for_comm",
                             (all_gather_comm, reduce_scatter_comm))
        for group in groups:
            group.configure(
                all_gather_comm=all_gather_comm(group.params.shard_group) if enable else None,
                reduce_scatter_comm=reduce_scatter_comm(group.params.shard_group) if enable else None,
            )

    def set_symm_mem_for_comm(self, backend: Literal["NCCL"] = "NCCL") -> None:
        """Eager, as FSDP2: this module's all-gather buffers (and, with sum-only comms, its
        reduce-scatter buffers) come from symmetric memory, through FSDP2's own ``SymmMem*``
        comms; where the backend is unavailable (no NCCL, e.g. on CPU) their constructor
        raises, as under FSDP2. A compiled graph allocates its own buffers: it raises while
        set.

        Args:
            backend: the symmetric-memory backend (FSDP2 supports ``"NCCL"``).
        """
        all_gather_comm, reduce_scatter_comm = fsdp2_comms("SymmMemAllGather", "SymmMemReduceScatter")
        groups = self._groups(recurse=False)
        check_no_custom_comm(groups, "set_symm_mem_for_comm", (all_gather_comm, reduce_scatter_comm))
        for group in groups:
            group.configure(all_gather_comm=all_gather_comm(group.params.shard_group, backend))
            if group.settings.force_sum_reduction:  # NCCL's symmetric reduce-scatter only sums
                group.configure(reduce_scatter_comm=reduce_scatter_comm(group.params.shard_group, backend))

    # -- torch's hooks into the module ----------------------------------------------------

    def _get_fsdp_state(self) -> FSDPModuleState:
        """The module's state (FSDP2's ``FSDPState`` shape; see :mod:`.module_state`)."""
        return state_of(self)

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # to()/to_empty() rebuild the parameters: reshard first, then re-read them.
        self.reshard()
        result = super(TorchFSDPModule, self)._apply(*args, **kwargs)
        self._fsdp_group.refresh_params()
        return result

    def register_forward_pre_hook(self, hook: Callable[..., Any], *, prepend: bool = False,
                                  with_kwargs: bool = False) -> RemovableHandle:
        """``nn.Module``'s, in FSDP2's order: the hook runs after the unshard (it sees
        the unsharded parameters and the cast inputs), or before it with ``prepend=True``.
        See [Note: forward hook order]."""
        if prepend:
            return super().register_forward_pre_hook(hook, prepend=True, with_kwargs=with_kwargs)
        return entry_of(self).inner_hooks.add_pre(hook, with_kwargs)

    def register_forward_hook(self, hook: Callable[..., Any], *, prepend: bool = False,
                              with_kwargs: bool = False, always_call: bool = False
                              ) -> RemovableHandle:
        """``nn.Module``'s, in FSDP2's order: the hook runs after the reshard, or before
        it (first of all) with ``prepend=True``. See [Note: forward hook order]."""
        if not prepend:
            return super().register_forward_hook(hook, with_kwargs=with_kwargs,
                                                 always_call=always_call)
        return entry_of(self).inner_hooks.add_post_first(hook, with_kwargs, always_call)

    # [Note: instance forward]
    # nn.Module.__call__ calls ``self.forward``, so a forward set on the instance shadows
    # the class's, where the group's forward work runs (FSDP2 works through hooks and is
    # not affected). torchtitan's ``Module.parallelize`` sets one on every module it
    # parallelizes, before fully_shard. Set before (moved at the class swap) or after
    # (``__setattr__``), it is kept in the module's entry (see [Note: a module's own
    # entry]) and ``forward`` calls it where a plain module's would call the class's.

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "forward":
            entry_of(self).instance_forward = value
        else:
            super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        if name == "forward" and entry_of(self).instance_forward is not None:
            entry_of(self).instance_forward = None
        else:
            super().__delattr__(name)

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile``, with FSDP2's split where no module below this one is
        ``fully_shard``-ed (a block): the module's compute (its forward and the forward
        hooks that run while its parameters are unsharded) is compiled; the group's
        all-gather, reduce-scatter and prefetches stay eager around it. Otherwise (the
        root) as torch's: the whole module, collectives included. See [Note: per-module
        compile].

        Args:
            args: ``torch.compile``'s arguments (``fullgraph``, ``backend``, ``options``...).
            kwargs: the same, by keyword.
        """
        if module_compile.compiles_compute_alone(self, is_sharded):
            entry_of(self).compiled_compute = torch.compile(self._fsdp_compute, *args, **kwargs)
        else:
            super().compile(*args, **kwargs)

    def _fsdp_compute(self, *args: Any, **kwargs: Any) -> Any:
        """The forward between the group's unshard and reshard, its parameters bound."""
        entry = entry_of(self)
        hooks = entry.inner_hooks
        if hooks.pre:
            args, kwargs = hooks.run_pre(self, args, kwargs)
        instance_forward = entry.instance_forward
        if instance_forward is None:
            output = super().forward(*args, **kwargs)
        else:
            output = instance_forward(*args, **kwargs)
        if hooks.post:
            output = hooks.run_post(self, args, kwargs, output)
        return output

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        group = self._fsdp_group
        entry = entry_of(self)
        traced_step_passes.prepare_traced_step()
        args, kwargs, scope = group.pre_forward(self, args, kwargs)
        try:
            # Traced (the module inside a larger compiled graph), the compiled compute is
            # traced over as the plain one.
            compiled_compute = None if comm.use_traced_path() else entry.compiled_compute
            region_call = self._fsdp_region_call(compiled_compute, scope, args, kwargs)
            if region_call is not None:
                scope = group.unbind_forward(scope)
                output = _forward_region(region_call, self)
            else:
                scope = group.bind_forward(scope)
                if compiled_compute is not None:
                    output = block_backward.call_compiled_compute(compiled_compute, args, kwargs)
                else:
                    output = self._fsdp_compute(*args, **kwargs)
        except BaseException:
            group.abort_forward(scope)
            if entry.inner_hooks.post_always:
                entry.inner_hooks.run_always_called(self, args, kwargs)
            raise
        return group.post_forward(self, scope, output)

    def _fsdp_region_call(self, compiled_compute: Callable[..., Any] | None,
                          scope: ForwardScope, args: tuple, kwargs: dict
                          ) -> tuple[int, tuple[torch.Tensor, ...]] | None:
        """The forward region this call runs as (see [Note: forward regions]), or
        ``None``: the one place that decides between a region, which binds the
        parameters itself, and the forward over the bound parameters."""
        if compiled_compute is not None or scope.unsharded is None:
            return None
        group, entry = self._fsdp_group, entry_of(self)
        hooks = entry.inner_hooks
        if (group.settings.inside_checkpoint_wrapper  # see [Note: activation checkpointing]
                or entry.instance_forward is not None or hooks.pre or hooks.post
                or not forward_regions.forward_regions_in_use() or not group.region_eligible):
            return None
        return forward_regions.call_key(self, scope.unsharded, args, kwargs)

    # -- helpers ------------------------------------------------------------------------

    def _groups(self, recurse: bool) -> list[ParamGroup]:
        """This module's parameter group (and every FSDP submodule's if ``recurse``)."""
        if not recurse:
            return [self._fsdp_group]
        return [m._fsdp_group for m in self.modules() if isinstance(m, FSDPModule)]

    def _set_group_flag(self, name: str, value: bool, recurse: bool,
                        also: tuple[str, ...] = ()) -> None:
        """Checks the bool argument ``name`` and sets the group attribute of that name
        (and those in ``also``) on this module's group, or on every group under it."""
        check_bool(name, value)
        groups = self._groups(recurse)
        for group in groups:
            group.configure(**dict.fromkeys((name, *also), value))
        if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
            log.debug("set %s=%s on groups %s", name, value, [g.name for g in groups])


def _unsupported(name: str) -> Callable[..., Any]:
    def method(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            f"FSDPModule.{name} is not supported by fsdp_traceable's fully_shard; see its "
            "docs/api.md for the supported methods (or use torch.distributed.fsdp.fully_shard)"
        )

    method.__name__ = name
    return method


# Every other method of torch's FSDPModule reads FSDP2's own state: fail clearly instead.
for _name, _value in vars(TorchFSDPModule).items():
    if callable(_value) and not _name.startswith("__") and _name not in vars(FSDPModule):
        setattr(FSDPModule, _name, _unsupported(_name))


def _log_prefetch(direction: str, group: ParamGroup, targets: list[ParamGroup]) -> None:
    if not torch.compiler.is_compiling() and log.isEnabledFor(logging.DEBUG):
        log.debug("%s prefetch of group %s set explicitly: %s", direction, group.log_name,
                  [t.log_name for t in targets])


class _UnshardHandle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` finishes the all-gather."""

    def __init__(self, group: ParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.wait_for_unshard()


def _bound_forward(module: FSDPModule, unsharded: tuple[torch.Tensor, ...], args: tuple,
                   kwargs: dict) -> Any:
    """The class forward of ``module`` over its bound ``unsharded`` parameters: the body
    of the forward region (see [Note: forward regions])."""
    params = module._fsdp_group.params
    params.bind(unsharded)
    output = super(FSDPModule, module).forward(*args, **kwargs)
    params.unbind()
    return output


_forward_region = (forward_regions.region_of(_bound_forward)
                   if forward_regions.regions_available() else None)
