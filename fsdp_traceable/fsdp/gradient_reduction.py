"""A parameter group's gradient reduction: reduce-scatter (and HSDP all-reduce) of the
unsharded gradients its backward produced, into sharded gradients.

Traced, the sharded gradients return through autograd; eager, the reduction is
started here and finished by the model's :class:`~.reduce_queue.ReduceQueue`, which
writes ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..collectives import ReduceResult, accumulate_sharded_grad, comm
from ..collectives.reduce import finish_foreach_reduce, start_foreach_reduce
from ..profiler_labels import phase

if TYPE_CHECKING:
    from .param_group import ParamGroup


def reduce_grads(
    group: ParamGroup,
    unsharded_grads: tuple[torch.Tensor | None, ...],
    accumulated: dict[int, torch.Tensor] | None = None,
) -> list[torch.Tensor | None]:
    """Reduce-scatters the trainable parameters' gradients into sharded gradients.

    ``accumulated``: earlier no-sync microbatches' unsharded gradients, by parameter
    index, passed in by a compiled backward; eager takes them from the group's state.
    """
    with phase("post_backward", group.name):
        return _reduce_grads(group, unsharded_grads, accumulated)


def post_backward(group: ParamGroup) -> None:
    """Eager, outside a backward pass: FSDP2's ``FSDPParamGroup.post_backward()``, which
    torch's pipeline stages call after their microbatches' no-sync backwards (see
    [Note: pipeline schedules]).

    With gradient sync on, the gradients accumulated so far are reduce-scattered (the
    model's reduce queue finishes them); with ``reshard_after_backward``, the
    parameters kept for backward are freed. A group with nothing accumulated reduces
    nothing, so a second call is a no-op.

    Args:
        group: the parameter group.
    """
    if group.eager.accumulated_unsharded_grads is not None and group.requires_gradient_sync:
        with phase("post_backward", group.name):
            _reduce_grads(group, (None,) * len(group.sharded_params), None)
    if group.reshard_after_backward:
        group.eager.unsharded_for_backward = None
        group.eager.forward_unsharded = None


def _reduce_grads(
    group: ParamGroup,
    unsharded_grads: tuple[torch.Tensor | None, ...],
    accumulated: dict[int, torch.Tensor] | None,
) -> list[torch.Tensor | None]:
    # Guarded: a traced backward must not mutate Python state (Dynamo refuses such
    # side effects inside an autograd.Function), and there it is always None.
    if group.reshard_after_backward and group.eager.unsharded_for_backward is not None:
        group.eager.unsharded_for_backward = None
    if group.eager.forward_unsharded is not None:
        if not group.reshard_after_backward and group.eager.unsharded_for_backward is None:
            group.eager.unsharded_for_backward = list(group.eager.forward_unsharded)
        group.eager.forward_unsharded = None
    # As in FSDP2, only parameters that received a gradient are reduced; the others
    # keep .grad None (which is what AdamW and weight decay expect).
    grads = {
        i: grad for i, (grad, param) in enumerate(zip(unsharded_grads, group.sharded_params))
        if grad is not None and param.requires_grad
    }
    if group.reduce_scatter_unused_params:
        for i, (info, param) in enumerate(zip(group.infos, group.sharded_params)):
            if i not in grads and param.requires_grad:
                grads[i] = torch.zeros(info.global_size, dtype=info.param_dtype,
                                       device=group.device)
    if not accumulated:
        accumulated = group.eager.take_accumulated_grads()
    if accumulated is not None or not group.requires_gradient_sync:
        # Accumulated no-sync gradients are kept in the reduce dtype, as FSDP2 does.
        grads = {i: g.to(group.infos[i].reduce_dtype) for i, g in grads.items()}
    if accumulated is not None:
        for i, earlier in accumulated.items():
            grads[i] = grads[i] + earlier if i in grads else earlier
    sharded_grads: list[torch.Tensor | None] = [None] * len(group.sharded_params)
    if not group.requires_gradient_sync:
        if comm.use_traced_path():
            raise NotImplementedError(
                "set_requires_gradient_sync(False) keeps unsharded gradients across "
                "backward calls, which a compiled backward cannot hold; accumulate "
                "with gradient sync on, or run the no-sync microbatches' backward "
                "eagerly (loss.backward() outside compiled_autograd._enable) and only "
                "the last microbatch, with set_requires_gradient_sync(True), compiled"
            )
        group.eager.accumulated_unsharded_grads = grads
        return sharded_grads
    if not grads:
        return sharded_grads
    indices = sorted(grads)
    skip_all_reduce = group.is_hsdp and not group.requires_all_reduce
    if skip_all_reduce and comm.use_traced_path():
        raise NotImplementedError(
            "set_requires_all_reduce(False) keeps the reduce-scattered gradients across "
            "backward calls, which a compiled backward cannot hold; run those "
            "microbatches' backward eagerly and only the last one compiled"
        )
    with phase("reduce_scatter", group.name):
        pending = start_foreach_reduce(
            [grads[i] for i in indices], [group.infos[i] for i in indices], group.shard_group,
            all_reduce_group=group.replicate_group,
            gradient_divide_factor=group.gradient_divide_factor,
            force_sum_reduction=group.force_sum_reduction,
            all_reduce_grads=not skip_all_reduce,
            partial_reduce_output=group.eager.take_partial_reduce_output(),
            all_reduce_hook=_all_reduce_hook(group),
            reduce_scatter_comm=group.reduce_scatter_comm,
            check=False,
        )
    if not comm.use_traced_path():
        # Eager, as FSDP2: the reduce-scatter runs while autograd computes the next
        # groups' gradients; the gradients reach .grad when it is finished (by the
        # next group's reduction or at the end of backward), not through autograd.
        group.root_state.reduce_queue.put(
            pending, lambda result: _accumulate(group, indices, result))
        return sharded_grads
    result = finish_foreach_reduce(pending)
    for i, grad in zip(indices, result.sharded_grads):
        sharded_grads[i] = grad
    return sharded_grads


def _accumulate(group: ParamGroup, indices: list[int], result: ReduceResult) -> None:
    """Eager: a finished reduction's gradients into the sharded parameters' ``.grad``."""
    if result.sharded_grads is None:
        group.eager.partial_reduce_output = result.partial_reduce_output
        return
    for i, grad in zip(indices, result.sharded_grads):
        param = group.sharded_params[i]
        # A zero-size parameter gets no gradient, as through autograd (see unshard_params).
        if param.numel():
            accumulate_sharded_grad(param, grad)


def _all_reduce_hook(group: ParamGroup) -> Callable[[torch.Tensor], None] | None:
    hook, stream = group.all_reduce_hook, group.all_reduce_hook_stream
    if hook is None or stream is None:
        return hook
    if comm.use_traced_path():
        raise NotImplementedError(
            "set_all_reduce_hook(stream=...) runs the hook on its own stream, which a "
            "compiled backward does not schedule: set the hook without stream="
        )

    def on_stream(reduce_output: torch.Tensor) -> None:
        device_module = torch.get_device_module(group.device.type)
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            hook(reduce_output)
        current.wait_stream(stream)

    return on_stream
