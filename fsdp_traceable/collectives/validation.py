"""Input checks for the foreach collectives, raised before any collective starts."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .. import config
from .divide_factors import SUPPORTED_REDUCE_OPS
from .shard_info import SUPPORTED_DTYPES, ShardInfo

_REDUCE_OP_NAMES = {dist.ReduceOp.SUM: "sum", dist.ReduceOp.AVG: "avg"}


def check_bucket(
    tensors: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    group: dist.ProcessGroup | None,
    *,
    tensors_name: str,
    expect: str,
) -> None:
    """Checks one bucket: non-empty, one info per tensor, sizes, dtypes, one device, group.

    ``expect`` is ``"sharded"`` (tensors have ``info.sharded_size``) or
    ``"unsharded"`` (``info.global_size``).
    """
    if not isinstance(tensors, (list, tuple)) or not all(
        isinstance(t, torch.Tensor) for t in tensors
    ):
        raise TypeError(f"{tensors_name} must be a list of tensors, got {type(tensors).__name__}")
    if not isinstance(infos, (list, tuple)) or not all(isinstance(i, ShardInfo) for i in infos):
        raise TypeError("infos must be a list of ShardInfo (see fsdp_traceable.make_shard_info)")
    if not tensors:
        raise ValueError(f"{tensors_name} is empty: pass at least one tensor per bucket")
    if len(tensors) != len(infos):
        raise ValueError(
            f"{tensors_name} has {len(tensors)} tensors but infos has {len(infos)}: "
            "pass one ShardInfo per tensor, in the same order"
        )
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(
            f"{tensors_name} are on several devices {sorted(map(str, devices))}: "
            "move every tensor of a bucket to one device"
        )
    for i, (tensor, info) in enumerate(zip(tensors, infos)):
        # An all-gather extension's inputs (e.g. float8 data) carry their own dtype as
        # the info's param_dtype and travel as bytes.
        if tensor.dtype not in SUPPORTED_DTYPES and tensor.dtype != info.param_dtype:
            raise TypeError(
                f"{tensors_name}[{i}] has dtype {tensor.dtype}; FSDP communicates "
                f"floating tensors of dtype {', '.join(map(str, SUPPORTED_DTYPES))}"
            )
        want = info.sharded_size if expect == "sharded" else info.global_size
        if tensor.shape != want:
            raise ValueError(
                f"{tensors_name}[{i}] has size {tuple(tensor.shape)} but its ShardInfo "
                f"expects the {expect} size {tuple(want)}"
            )
    world_sizes = {info.world_size for info in infos}
    ranks = {info.rank for info in infos}
    if len(world_sizes) != 1 or len(ranks) != 1:
        raise ValueError(
            "infos mix world sizes or ranks; build every ShardInfo of a bucket for one group"
        )
    if group is not None:
        group_size, group_rank = group.size(), group.rank()
        if (group_size, group_rank) != (infos[0].world_size, infos[0].rank):
            raise ValueError(
                f"infos were built for world_size={infos[0].world_size}, rank={infos[0].rank} "
                f"but the group has size {group_size} and this rank is {group_rank}: "
                "build the infos from the group you communicate over"
            )


def bucket_bytes(infos: Sequence[ShardInfo]) -> int:
    """The larger of a bucket's all-gather output and reduce-scatter input, in bytes.

    The all-gather output holds every rank's padded shards in their ``param_dtype``
    (the byte sizes add up for mixed dtypes, which travel as ``uint8``); the
    reduce-scatter input the same elements in ``reduce_dtype``.
    """
    if not infos:
        return 0
    world_size = infos[0].world_size
    gathered = sum(i.padded_sharded_numel * i.param_dtype.itemsize for i in infos)
    reduced = sum(i.padded_sharded_numel * i.reduce_dtype.itemsize for i in infos)
    return world_size * max(gathered, reduced)


def check_bucket_bytes(infos: Sequence[ShardInfo], names: Sequence[str] | None = None) -> None:
    """Rejects a bucket larger than ``config.max_bucket_bytes``, before anything is allocated.

    Args:
        infos: one :class:`ShardInfo` per parameter of the bucket.
        names: the parameters' names, to name the largest ones in the error.
    """
    limit = config.max_bucket_bytes
    total = bucket_bytes(infos)
    if total <= limit:
        return
    names = list(names) if names is not None else [f"infos[{i}]" for i in range(len(infos))]
    largest = sorted(zip(infos, names), key=lambda pair: -pair[0].global_numel)[:3]
    listed = ", ".join(f"{name!r} {tuple(info.global_size)}" for info, name in largest)
    raise ValueError(
        f"a bucket of {len(infos)} parameter{'s' * (len(infos) != 1)} (largest: {listed}) "
        f"needs {total} bytes per "
        f"collective across {infos[0].world_size} ranks, over the limit of {limit} bytes "
        "(fsdp_traceable.config.max_bucket_bytes): split the module into smaller fully_shard "
        "groups (apply fully_shard to its submodules first), or raise the limit"
    )


def check_uniform(values: Sequence[object], what: str, fix: str) -> object:
    """Returns the single value of ``values`` or raises a ``ValueError`` naming ``what``."""
    first = values[0]
    for value in values:
        if value != first:
            distinct = sorted(set(map(str, values)))
            raise ValueError(f"{what} must be uniform across the bucket, got {distinct}: {fix}")
    return first


def normalize_reduce_op(reduce_op: object, group: dist.ProcessGroup | None) -> str:
    """Returns the functional-collective name of ``reduce_op`` if every backend has it."""
    if isinstance(reduce_op, str) and reduce_op.lower() in SUPPORTED_REDUCE_OPS:
        return reduce_op.lower()
    if isinstance(reduce_op, dist.ReduceOp.RedOpType) and reduce_op in _REDUCE_OP_NAMES:
        return _REDUCE_OP_NAMES[reduce_op]
    try:
        backend = f" on the {dist.get_backend(group)} backend" if group is not None else ""
    except (RuntimeError, ValueError):
        backend = ""
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported for gradient reduction{backend}: use 'sum' or 'avg' "
        "(or ReduceOp.SUM / ReduceOp.AVG), and gradient_divide_factor for other scalings"
    )


def check_reduce_state(
    infos: Sequence[ShardInfo],
    reduce_dtype: torch.dtype,
    *,
    has_all_reduce_group: bool,
    all_reduce_grads: bool,
    partial_reduce_output: torch.Tensor | None,
    accumulate_into: Sequence[torch.Tensor] | None,
) -> None:
    """Checks ``foreach_reduce``'s optional state arguments against the bucket."""
    if reduce_dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"reduce_dtype={reduce_dtype} cannot be reduced: FSDP reduces gradients of "
            f"dtype {', '.join(map(str, SUPPORTED_DTYPES))}; a parameter of another dtype "
            "is gathered only (frozen)"
        )
    if not all_reduce_grads and not has_all_reduce_group:
        raise ValueError(
            "all_reduce_grads=False skips the HSDP all-reduce, but no all_reduce_group "
            "was given: pass the replicate group, or leave all_reduce_grads=True"
        )
    if partial_reduce_output is not None:
        numel = sum(info.padded_sharded_numel for info in infos)
        if (
            not isinstance(partial_reduce_output, torch.Tensor)
            or partial_reduce_output.shape != (numel,)
            or partial_reduce_output.dtype != reduce_dtype
        ):
            got = (
                f"{tuple(partial_reduce_output.shape)} {partial_reduce_output.dtype}"
                if isinstance(partial_reduce_output, torch.Tensor)
                else type(partial_reduce_output).__name__
            )
            raise ValueError(
                f"partial_reduce_output must be a flat ({numel},) {reduce_dtype} tensor, "
                f"got {got}: pass the partial_reduce_output a previous call returned"
            )
    if accumulate_into is None:
        return
    if len(accumulate_into) != len(infos):
        raise ValueError(
            f"accumulate_into has {len(accumulate_into)} parameters for {len(infos)} "
            "gradients: pass one sharded parameter per gradient"
        )
    for i, (param, info) in enumerate(zip(accumulate_into, infos)):
        if not isinstance(param, torch.Tensor):
            raise TypeError(f"accumulate_into[{i}] must be a tensor, got {type(param).__name__}")
        local = param._local_tensor if isinstance(param, DTensor) else param
        if local.shape != info.sharded_size or local.dtype != info.orig_dtype:
            raise ValueError(
                f"accumulate_into[{i}] has local size {tuple(local.shape)} and dtype "
                f"{local.dtype}; its gradient will have {tuple(info.sharded_size)} "
                f"{info.orig_dtype}: pass the sharded parameter the ShardInfo describes"
            )
