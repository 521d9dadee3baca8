"""A parameter group's gradient reduction, as functions of its parameters and settings:
which unsharded gradients its backward reduces, and the start of their reduce-scatter
(and HSDP all-reduce). They change nothing of the group; the group's
``post_backward`` (:class:`~.param_group.ParamGroup`) keeps what must outlive the
call, and, eager, hands the started reduction to the model's
:class:`~.reduce_queue.ReduceQueue`, which finishes it into ``.grad``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from ..collectives import comm
from ..collectives.grad_dtypes import keeps_wider_grads, output_grad_dtypes
from ..collectives.reduce import PendingReduce, start_foreach_reduce
from ..profiler_labels import phase
from ..traced_errors import raise_not_implemented

if TYPE_CHECKING:
    from .group_settings import GroupSettings
    from .param_shards import ParamShards


def declare_grad_dtypes(ctx: torch.autograd.function.FunctionCtx, params: ParamShards,
                        unsharded: Sequence[torch.Tensor]) -> None:
    """Lets the unsharded parameters' gradients reach the eager backward in the dtype
    their ops computed them in, where this torch's FSDP2 keeps them so (see
    [Note: wider gradient dtypes]).

    Args:
        ctx: the forward's context of the Function whose outputs are ``unsharded``.
        params: the group's parameters.
        unsharded: the group's unsharded parameters, the Function's outputs.
    """
    if comm.use_traced_path():
        return
    dtypes = output_grad_dtypes(params.infos, unsharded,
                                [p.requires_grad for p in params.sharded_params],
                                [layout is not None for layout in params.tp_layouts])
    if dtypes is not None:
        ctx.set_output_grad_dtype(*dtypes)


def gradients_to_reduce(
    params: ParamShards,
    settings: GroupSettings,
    unsharded_grads: tuple[torch.Tensor | None, ...],
    accumulated: dict[int, torch.Tensor] | None,
) -> dict[int, torch.Tensor]:
    """The gradients to reduce, by parameter index.

    Args:
        params: the parameters of the group whose backward produced ``unsharded_grads``.
        settings: the group's settings.
        unsharded_grads: the backward's gradient per parameter (``None`` if none).
        accumulated: earlier no-sync microbatches' unsharded gradients, by index.

    Returns:
        The trainable parameters' gradients (zeros for unused ones with
        ``reduce_scatter_unused_params``), with ``accumulated`` added; in the reduce
        dtype when accumulating.

    Raises:
        NotImplementedError: a traced backward without gradient sync.
    """
    # As in FSDP2, only parameters that received a gradient are reduced; the others
    # keep .grad None (which is what AdamW and weight decay expect).
    # zip(range()), not enumerate(): Dynamo traces enumerate's polyfill per item.
    grads = {
        i: grad for i, grad, param in zip(range(len(unsharded_grads)), unsharded_grads,
                                          params.sharded_params)
        if grad is not None and param.requires_grad
    }
    if settings.reduce_scatter_unused_params:
        for i, (info, param) in enumerate(zip(params.infos, params.sharded_params)):
            if i not in grads and param.requires_grad:
                grads[i] = torch.zeros(info.global_size, dtype=info.param_dtype,
                                       device=params.device)
    if accumulated is not None or not settings.requires_gradient_sync:
        # Accumulated no-sync gradients are kept in the reduce dtype, as FSDP2 does.
        # Before torch 2.15 its accumulator adds a microbatch's gradient as computed (in
        # place: the sum rounded once); from 2.15 the gradient is cast first (see
        # [Note: wider gradient dtypes]).
        add_then_cast = not keeps_wider_grads()
        for i, grad in grads.items():
            reduce_dtype = params.infos[i].reduce_dtype
            earlier = None if accumulated is None else accumulated.get(i)
            if earlier is not None and add_then_cast:
                grads[i] = torch.add(earlier, grad).to(reduce_dtype)
            else:
                grad = grad.to(reduce_dtype)
                grads[i] = grad if earlier is None else grad + earlier
        for i, earlier in (accumulated or {}).items():
            grads.setdefault(i, earlier)
    if not settings.requires_gradient_sync and comm.use_traced_path():
        # Under fullgraph=True too, this message is what the user reads first (see
        # [Note: errors raised while Dynamo traces]).
        raise_not_implemented(
            "set_requires_gradient_sync(False) keeps unsharded gradients across "
            "backward calls, which a compiled backward cannot hold; accumulate "
            "with gradient sync on, or run the no-sync microbatches' backward "
            "eagerly (loss.backward() outside compiled_autograd._enable) and only "
            "the last microbatch, with set_requires_gradient_sync(True), compiled"
        )
    return grads


def start_reduce(params: ParamShards, settings: GroupSettings, grads: dict[int, torch.Tensor],
                 indices: list[int], partial_reduce_output: torch.Tensor | None, *,
                 name: str) -> PendingReduce:
    """Starts the reduce-scatter (and HSDP all-reduce) of ``grads``.

    Args:
        params: the parameters of the group the gradients belong to.
        settings: the group's settings.
        grads: the gradients to reduce, by parameter index (from :func:`gradients_to_reduce`).
        indices: ``sorted(grads)``, the bucket's order.
        partial_reduce_output: HSDP's reduce-scatter output kept from the previous
            backward while the all-reduce was skipped (added to this one), or None.
        name: the group's name, for the profiler label.

    Returns:
        The started reduction.
    """
    skip_all_reduce = params.is_hsdp and not settings.requires_all_reduce
    if skip_all_reduce and comm.use_traced_path():
        raise NotImplementedError(
            "set_requires_all_reduce(False) keeps the reduce-scattered gradients across "
            "backward calls, which a compiled backward cannot hold; run those "
            "microbatches' backward eagerly and only the last one compiled"
        )
    bucket = [grads[i] for i in indices]
    if len({grad.dtype for grad in bucket}) > 1:
        # Compute-dtype gradients beside wider ones (see [Note: wider gradient dtypes]),
        # each cast to the reduce dtype first, as FSDP2's chunk_cat_mixed_dtype does
        # off CUDA: the same values as a cast in the copy-in.
        bucket = [grad.to(params.infos[i].reduce_dtype) for grad, i in zip(bucket, indices)]
    with phase("reduce_scatter", name):
        whole_bucket = len(indices) == len(params.infos)
        return start_foreach_reduce(
            bucket,
            params.infos if whole_bucket else [params.infos[i] for i in indices],
            params.shard_group,
            all_reduce_group=params.replicate_group,
            gradient_divide_factor=settings.gradient_divide_factor,
            force_sum_reduction=settings.force_sum_reduction,
            all_reduce_grads=not skip_all_reduce,
            partial_reduce_output=partial_reduce_output,
            all_reduce_hook=_all_reduce_hook(settings, params.device),
            reduce_scatter_comm=settings.reduce_scatter_comm,
            check=False,
            layout=params.layout if whole_bucket else None,
        )


def _all_reduce_hook(settings: GroupSettings, device: torch.device
                     ) -> Callable[[torch.Tensor], None] | None:
    hook, stream = settings.all_reduce_hook, settings.all_reduce_hook_stream
    if hook is None or stream is None:
        return hook
    if comm.use_traced_path():
        raise NotImplementedError(
            "set_all_reduce_hook(stream=...) runs the hook on its own stream, which a "
            "compiled backward does not schedule: set the hook without stream="
        )

    def on_stream(reduce_output: torch.Tensor) -> None:
        device_module = torch.get_device_module(device.type)
        current = device_module.current_stream()
        stream.wait_stream(current)
        with device_module.stream(stream):
            hook(reduce_output)
        current.wait_stream(stream)

    return on_stream
