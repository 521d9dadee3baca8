"""``FSDPModule``'s gradient-reduction and prefetch setters, with FSDP2's meaning.

Each is assigned as a method of :class:`~fsdp_traceable.fsdp.fsdp_module.FSDPModule`;
they change plain attributes of the parameter groups, which the forward and backward
read (so a compiled graph guards on them and recompiles once when one changes).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.nn as nn
from typing_extensions import deprecated

if TYPE_CHECKING:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    from .fsdp_module import FSDPModule
    from .param_group import ParamGroup


def groups_of(module: nn.Module, recurse: bool) -> list[ParamGroup]:
    """The parameter group of ``module`` (and of every FSDP submodule if ``recurse``)."""
    from .fsdp_module import FSDPModule

    if not recurse:
        return [module._fsdp_group]
    return [m._fsdp_group for m in module.modules() if isinstance(m, FSDPModule)]


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} {value!r}")


def set_requires_all_reduce(
    self: FSDPModule, requires_all_reduce: bool, *, recurse: bool = True
) -> None:
    """HSDP: whether backward all-reduces the reduce-scattered gradients.

    ``False`` keeps the reduce-scatter output and adds the next backward's to it (no
    gradient is written until a backward all-reduces): accumulation with only
    intra-replica communication. Without HSDP it changes nothing, as in FSDP2.

    Args:
        requires_all_reduce: ``False`` for all but the last microbatch.
        recurse: apply to every ``fully_shard``-ed submodule too.
    """
    check_bool("requires_all_reduce", requires_all_reduce)
    for group in groups_of(self, recurse):
        group.requires_all_reduce = requires_all_reduce


def set_gradient_divide_factor(self: FSDPModule, factor: float) -> None:
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
    self._fsdp_group.gradient_divide_factor = float(factor)


@deprecated("Use `set_gradient_divide_factor` instead")
def set_reduce_scatter_divide_factor(self: FSDPModule, factor: float) -> None:
    """Use :meth:`set_gradient_divide_factor` instead."""
    self.set_gradient_divide_factor(factor)


def set_force_sum_reduction_for_comms(self: FSDPModule, enable: bool) -> None:
    """Whether this module's collectives reduce with ``sum`` only (divides done apart).

    Args:
        enable: ``True`` for sum-only collectives and explicit divides.
    """
    check_bool("enable", enable)
    self._fsdp_group.force_sum_reduction = enable


def set_reduce_scatter_unused_params(
    self: FSDPModule, reduce_scatter_unused_params: bool, *, recurse: bool = True
) -> None:
    """Whether parameters that got no gradient join the reduce-scatter with zeros.

    Needed when ranks use different parameters (conditional control flow), so every
    rank issues the same reduce-scatter; those parameters then get a gradient.

    Args:
        reduce_scatter_unused_params: ``True`` to reduce zeros for unused parameters.
        recurse: apply to every ``fully_shard``-ed submodule too.
    """
    check_bool("reduce_scatter_unused_params", reduce_scatter_unused_params)
    for group in groups_of(self, recurse):
        group.reduce_scatter_unused_params = reduce_scatter_unused_params


def set_all_reduce_hook(
    self: FSDPModule,
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
    if stream is not None and group.is_hsdp:
        raise ValueError("stream cannot be set when using native HSDP")
    group.all_reduce_hook = hook
    group.all_reduce_hook_stream = stream


def set_modules_to_forward_prefetch(self: FSDPModule, modules: list[FSDPModule]) -> None:
    """Eager: after this module's all-gather, issue the all-gathers of ``modules``.

    Replaces the default (the next group in forward order). A compiled forward's
    all-gathers are placed by Inductor, so a non-empty list raises there.

    Args:
        modules: ``fully_shard``-ed modules, typically the next one or two blocks.
    """
    self._fsdp_next_groups = [m._fsdp_group for m in _check_fsdp_modules(modules)]
    self._fsdp_group.explicit_forward_prefetch = bool(modules)


def set_modules_to_backward_prefetch(self: FSDPModule, modules: list[FSDPModule]) -> None:
    """Eager: after this module's backward all-gather, issue the all-gathers of ``modules``.

    Replaces the default (the previous group in forward order). Raises under a
    compiled backward when non-empty, as the forward setter does.

    Args:
        modules: ``fully_shard``-ed modules, typically the previous one or two blocks.
    """
    groups = [m._fsdp_group for m in _check_fsdp_modules(modules)]
    group = self._fsdp_group
    group.prefetch_backward = _prefetch_all(groups) if groups else None
    group.explicit_backward_prefetch = bool(modules)


def set_unshard_in_backward(self: FSDPModule, unshard_in_backward: bool) -> None:
    """Whether this module's backward may all-gather its parameters.

    Our backward all-gathers a group only when its backward reads the parameters, so
    ``False`` removes no all-gather FSDP2 would skip; it turns a backward that does
    read them into a clear error (FSDP2 would compute with the sharded parameters).

    Args:
        unshard_in_backward: ``False`` for modules whose backward needs no parameters.
    """
    check_bool("unshard_in_backward", unshard_in_backward)
    self._fsdp_group.unshard_in_backward = unshard_in_backward


def _prefetch_all(groups: list[ParamGroup]) -> Callable[[], None]:
    def prefetch() -> None:
        for group in groups:
            group.prefetch()

    return prefetch


def _check_fsdp_modules(modules: Any) -> list[FSDPModule]:
    from .fsdp_module import FSDPModule

    if not isinstance(modules, (list, tuple)):
        raise TypeError(f"modules must be a list of FSDPModules, got {type(modules).__name__}")
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(
                f"Expects FSDPModule but got {type(module).__name__}: pass modules "
                "fsdp_traceable.fully_shard was applied to"
            )
    return list(modules)


def set_post_optim_event(self: FSDPModule, event: torch.Event) -> None:
    """Eager: the next all-gather copy-in of every group under this module waits on
    ``event`` (recorded after the optimizer step) instead of on the whole current
    stream; the event is used once, so set a new one each iteration.

    A compiled graph runs its all-gathers on the current stream, after the optimizer
    step that stream already ordered, so there the event has nothing to add.

    Args:
        event: an event recorded after ``optimizer.step()``.
    """
    for group in groups_of(self, recurse=True):
        group.streams.post_optim_event = event


def set_custom_all_gather(self: FSDPModule, comm: AllGather) -> None:
    """Eager: this module's all-gathers allocate their output with ``comm.allocate``
    and run ``comm(output, input, group, async_op=True)`` (FSDP2's ``AllGather``).

    A compiled graph all-gathers with functional collectives: it raises while set.

    Args:
        comm: an FSDP2 ``AllGather`` (``allocate`` and ``__call__``).
    """
    self._fsdp_group.all_gather_comm = _check_comm(comm, "comm")


def set_custom_reduce_scatter(self: FSDPModule, comm: ReduceScatter) -> None:
    """Eager: this module's reduce-scatters allocate their input and output with
    ``comm.allocate`` and run ``comm(output, input, group, op, async_op=True)``
    (FSDP2's ``ReduceScatter``); the copy-in's result is copied into the input.

    A compiled backward reduces with functional collectives: it raises while set.

    Args:
        comm: an FSDP2 ``ReduceScatter`` (``allocate`` and ``__call__``).
    """
    self._fsdp_group.reduce_scatter_comm = _check_comm(comm, "comm")


def _check_comm(comm: Any, name: str) -> Any:
    if not callable(comm) or not callable(getattr(comm, "allocate", None)):
        raise TypeError(
            f"{name} must implement FSDP2's comm interface (allocate() and __call__), got "
            f"{type(comm).__name__}"
        )
    return comm


def set_allocate_memory_from_process_group_for_comm(self: FSDPModule, enable: bool) -> None:
    """Eager, as FSDP2: this module's all-gather and reduce-scatter buffers come from the
    process group's allocator where its backend has one (NCCL's memory pool), else from
    ``torch.empty``; through FSDP2's own ``ProcessGroupAlloc*`` comms, so the collectives
    and numbers are FSDP2's. A compiled graph allocates its own buffers: it raises while
    on.

    Args:
        enable: whether to allocate from the process group.
    """
    check_bool("enable", enable)
    all_gather_comm, reduce_scatter_comm = _fsdp2_comms(
        "ProcessGroupAllocAllGather", "ProcessGroupAllocReduceScatter")
    groups = groups_of(self, recurse=False)
    _check_no_custom_comm(groups, "set_allocate_memory_from_process_group_for_comm",
                          (all_gather_comm, reduce_scatter_comm))
    for group in groups:
        group.all_gather_comm = all_gather_comm(group.shard_group) if enable else None
        group.reduce_scatter_comm = reduce_scatter_comm(group.shard_group) if enable else None


def set_symm_mem_for_comm(self: FSDPModule, backend: Literal["NCCL"] = "NCCL") -> None:
    """Eager, as FSDP2: this module's all-gather buffers (and, with sum-only comms, its
    reduce-scatter buffers) come from symmetric memory, through FSDP2's own ``SymmMem*``
    comms; where the backend is unavailable (no NCCL, e.g. on CPU) their constructor
    raises, as under FSDP2. A compiled graph allocates its own buffers: it raises while
    set.

    Args:
        backend: the symmetric-memory backend (FSDP2 supports ``"NCCL"``).
    """
    all_gather_comm, reduce_scatter_comm = _fsdp2_comms("SymmMemAllGather", "SymmMemReduceScatter")
    groups = groups_of(self, recurse=False)
    _check_no_custom_comm(groups, "set_symm_mem_for_comm", (all_gather_comm, reduce_scatter_comm))
    for group in groups:
        group.all_gather_comm = all_gather_comm(group.shard_group, backend)
        if group.force_sum_reduction:  # NCCL's symmetric reduce-scatter only sums
            group.reduce_scatter_comm = reduce_scatter_comm(group.shard_group, backend)


def _fsdp2_comms(*names: str) -> list[type]:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    missing = [name for name in names if not hasattr(_fsdp_collectives, name)]
    if missing:
        raise NotImplementedError(
            f"this setter uses FSDP2's {', '.join(missing)}, which torch {torch.__version__} "
            "does not have; upgrade torch"
        )
    return [getattr(_fsdp_collectives, name) for name in names]


def _check_no_custom_comm(groups: list[ParamGroup], method: str, allowed: tuple[type, ...]) -> None:
    for group in groups:
        for comm, setter in ((group.all_gather_comm, "set_custom_all_gather"),
                             (group.reduce_scatter_comm, "set_custom_reduce_scatter")):
            if comm is not None and not isinstance(comm, allowed):
                raise ValueError(
                    f"{method}() replaces the comm that {setter}() set "
                    f"({type(comm).__name__}); FSDP2 does not combine them either: use one"
                )
