"""The two implementations of each collective behind one call.

Traced: functional collectives (``torch.ops._c10d_functional``), which Dynamo,
AOTAutograd, compiled autograd and Inductor trace and schedule. Eager: c10d with
``async_op=True`` into preallocated outputs. Both call the same backend kernel on the
same input, so their results are bitwise identical.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .. import config

if TYPE_CHECKING:  # FSDP2's comm interfaces, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from ..tracing import is_tracing

_C10D_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}

# c10d's flat collectives: the names torch 2.13 introduced where torch has them (the
# older names warn there), else the older names, which have the same semantics (2.11,
# 2.12). Looked up on ``torch.distributed`` at call time, so a patch of it sees the call.
ALL_GATHER_C10D = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
REDUCE_SCATTER_C10D = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


# [Note: eager path and traced path]
# Each collective and each FSDP phase has two implementations, chosen per call by
# use_traced_path(). Traced (while Dynamo traces, or collectives_path="traced"): pure
# functional ops and functional collectives whose results are tensors of the graph, so
# Inductor can fuse the copies, order and overlap the collectives, and the graph holds
# all state. Eager: c10d collectives on the device's streams with async work handles, as
# FSDP2's, and Python-side state (a prefetched all-gather, the reduce queue, gradients
# kept across microbatches) carries results from one hook to the next. Python state is
# kept on the eager path only (see [Note: a traced backward mutates no Python state]);
# both paths compute the same numbers, which the parity tests compare bit for bit.


def use_traced_path() -> bool:
    """Whether the collectives run as functional collectives right now (see
    [Note: eager path and traced path])."""
    path = config.collectives_path
    if path == "auto":
        # is_compiling() first: where Dynamo traces this (per block of a per-block
        # compiled backward, several times), it answers without another frame.
        return torch.compiler.is_compiling() or is_tracing()
    if path not in ("traced", "eager"):
        raise ValueError(
            f"fsdp_traceable.config.collectives_path={path!r}; use 'auto', 'traced' or 'eager'"
        )
    return path == "traced"


class PendingTensor(NamedTuple):
    """A collective's output, valid once :func:`wait` returns it."""

    tensor: torch.Tensor
    work: dist.Work | None


def wait(pending: PendingTensor) -> torch.Tensor:
    if pending.work is not None:
        pending.work.wait()
        return pending.tensor
    if use_traced_path() or isinstance(pending.tensor, funcol.AsyncCollectiveTensor):
        return funcol.wait_tensor(pending.tensor)
    return pending.tensor


def group_name(group: dist.ProcessGroup) -> str:
    """The name functional collectives address ``group`` by."""
    return funcol._resolve_group_name(group)


def all_gather(flat_input: torch.Tensor, group: dist.ProcessGroup) -> PendingTensor:
    """Starts an all-gather of ``flat_input`` into ``[world_size * numel]``."""
    if use_traced_path():
        # The raw op, not funcol.all_gather_single: while tracing, the latter waits
        # right away, which would serialise the all-gather with the compute the
        # caller runs before copy-out. The wait is in :func:`wait`.
        output = torch.ops._c10d_functional.all_gather_into_tensor(
            flat_input, group.size(), group_name(group)
        )
        return PendingTensor(output, None)
    output = flat_input.new_empty(flat_input.numel() * group.size())
    return all_gather_into(output, flat_input, group)


def all_gather_into(
    output: torch.Tensor,
    flat_input: torch.Tensor,
    group: dist.ProcessGroup,
    custom: Callable[..., dist.Work | None] | None = None,
) -> PendingTensor:
    """Eager: starts an async all-gather of ``flat_input`` into ``output`` (``flat_input``
    may be this rank's slice of ``output``, FSDP2's in-place layout), with c10d or a
    custom FSDP2 ``AllGather``."""
    if custom is not None:
        return PendingTensor(output, custom(output, flat_input, group, async_op=True))
    if group.size() == 1:  # FSDP2 skips the collective too: the input is the output
        if flat_input.data_ptr() != output.data_ptr():
            output.copy_(flat_input)
        return PendingTensor(output, None)
    work = getattr(dist, ALL_GATHER_C10D)(output, flat_input, group=group, async_op=True)
    return PendingTensor(output, work)


def start_reduce_scatter(
    flat_input: torch.Tensor,
    op: str,
    group: dist.ProcessGroup,
    custom: ReduceScatter | None = None,
) -> PendingTensor:
    """Starts a reduce-scatter of ``flat_input`` with ``op`` (``"sum"`` or ``"avg"``);
    :func:`wait` returns its output (eager: an async c10d call, whose work keeps
    ``flat_input`` alive until it completes; or a custom FSDP2 ``ReduceScatter``, whose
    ``allocate`` makes the input and output buffers)."""
    if custom is not None:
        if use_traced_path():
            raise NotImplementedError(
                "a custom reduce-scatter (set_custom_reduce_scatter) runs eagerly only: a "
                "compiled backward reduces with functional collectives; unset it before "
                "compiling (set_symm_mem_for_comm and "
                "set_allocate_memory_from_process_group_for_comm set one too)"
            )
        numel = flat_input.numel()
        comm_input = custom.allocate((numel,), dtype=flat_input.dtype, device=flat_input.device)
        comm_input.copy_(flat_input)
        output = custom.allocate((numel // group.size(),), dtype=flat_input.dtype,
                                 device=flat_input.device)
        work = custom(output, comm_input, group, _C10D_OPS[op], async_op=True)
        return PendingTensor(output, work)
    if use_traced_path():
        # The raw op; the wait is in :func:`wait` (funcol's wrappers wait while tracing).
        output = torch.ops._c10d_functional.reduce_scatter_tensor(
            flat_input, op, group.size(), group_name(group)
        )
        return PendingTensor(output, None)
    output = flat_input.new_empty(flat_input.numel() // group.size())
    work = getattr(dist, REDUCE_SCATTER_C10D)(output, flat_input, op=_C10D_OPS[op], group=group,
                                              async_op=True)
    return PendingTensor(output, work)


def all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup) -> torch.Tensor:
    """All-reduces ``tensor`` out of place with ``op`` and waits."""
    if use_traced_path():
        output = torch.ops._c10d_functional.all_reduce(tensor, op, group_name(group))
        return funcol.wait_tensor(output)
    output = tensor.clone()
    dist.all_reduce(output, op=_C10D_OPS[op], group=group)
    return output


class DeviceStreams:
    """Copy-in and communication streams where the device has streams; no-ops on CPU.

    The copy-in of the next bucket runs on its own stream so it can overlap the
    current compute; the consumer waits on the recorded event before reading.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        module = getattr(torch, device.type, None)
        self._has_streams = device.type != "cpu" and hasattr(module, "Stream")
        self.copy_in = module.Stream(device=device) if self._has_streams else None
        # FSDP2's post-optimizer event: the next copy-in waits on it instead of on all
        # work queued so far on the current stream.
        self._post_optim_event: torch.Event | None = None

    @property
    def post_optim_event(self) -> torch.Event | None:
        """The event the next copy-in waits on, if one is set."""
        return self._post_optim_event

    def set_post_optim_event(self, event: torch.Event) -> None:
        """The next copy-in (only) waits on ``event`` instead of the whole current stream."""
        self._post_optim_event = event

    def copy_in_context(self) -> contextlib.AbstractContextManager:
        """Runs the copy-in (and the collective that reads it) on the copy-in stream."""
        event, self._post_optim_event = self._post_optim_event, None
        if not self._has_streams:
            return contextlib.nullcontext()
        if event is not None:
            self.copy_in.wait_event(event)
        else:
            self.copy_in.wait_stream(torch.get_device_module(self.device.type).current_stream())
        return torch.get_device_module(self.device.type).stream(self.copy_in)

    def consume(self, tensor: torch.Tensor) -> None:
        """Makes the current stream wait for the copy-in stream's work on ``tensor``."""
        if not self._has_streams:
            return
        current = torch.get_device_module(self.device.type).current_stream()
        current.wait_stream(self.copy_in)
        tensor.record_stream(current)
