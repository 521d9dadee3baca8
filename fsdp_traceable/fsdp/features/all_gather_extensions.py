"""FSDP2's all-gather extension: a local tensor subclass that all-gathers itself.

A sharded parameter whose local tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` (torchao's float8 weights) is all-gathered through them, with
FSDP2's contract (torch 2.13, ``_fsdp_param.py``):

* ``fsdp_pre_all_gather(mesh, orig_size, contiguous_orig_stride, module, mp_policy)``
  (or the older ``fsdp_pre_all_gather(mesh)``) returns ``(all_gather_inputs, metadata)``:
  one or more tensors per parameter, of any dtypes, each all-gathered along dim 0
  (the bucket travels as ``uint8`` when the dtypes differ); an unevenly sharded
  parameter must return inputs of the padded sharded size.
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` receives each gathered input
  as ``gathered.view(-1, *input_size[1:])`` and returns ``(unsharded, inner_tensors)``.

As in FSDP2, the hooks are looked up on the local tensor at every all-gather, so hooks
set after ``fully_shard`` (on the subclass, or on the local tensor itself, as FSDP2's
tests monkey-patch them) take effect at the next all-gather; ``fully_shard`` only checks
the hooks the tensor has then. The post hook is always called without ``out=``: here
every all-gather returns fresh tensors, so there is no earlier unsharded parameter to
refill.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from ...collectives import AllGatherResult, ShardInfo, comm
from ...sizes import contiguous_strides

_PRE_HOOK, _POST_HOOK = "fsdp_pre_all_gather", "fsdp_post_all_gather"
_PRE_HOOK_SIGNATURE = (
    "fsdp_pre_all_gather(self, mesh: DeviceMesh, outer_size: torch.Size, "
    "outer_stride: tuple[int, ...], module: nn.Module, mp_policy: MixedPrecisionPolicy)"
)


@dataclass
class AllGatherExtension:
    """How one parameter's local tensor subclass is all-gathered through its hooks.

    Built by :func:`detect_extension` at every all-gather, from the hooks the local
    tensor has then.
    """

    fqn: str
    info: ShardInfo
    # The hooks as functions called with the local tensor first (a method's function):
    # Dynamo inlines such a call, where a method call on a tensor would become a graph op.
    pre_hook: Callable[..., tuple[Sequence[torch.Tensor], object]]
    post_hook: Callable[..., tuple[torch.Tensor, object]]
    pre_takes_mesh_only: bool
    shard_mesh: DeviceMesh
    mp_policy: MixedPrecisionPolicy
    # The first module holding the parameter (FSDP2 passes it to the pre hook).
    module: nn.Module | None = None
    # The unsharded parameter's contiguous stride, computed once.
    global_stride: tuple[int, ...] = field(init=False)

    def __post_init__(self) -> None:
        self.global_stride = contiguous_strides(self.info.global_size)

    def pre_all_gather(self, local: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """Calls the pre hook on ``local``; returns its all-gather inputs and metadata."""
        if self.pre_takes_mesh_only:
            inputs, metadata = self.pre_hook(local, self.shard_mesh)
        else:
            inputs, metadata = self.pre_hook(
                local, self.shard_mesh, self.info.global_size, self.global_stride,
                self.module, self.mp_policy,
            )
        inputs = list(inputs)
        padded = self.info.padded_sharded_size
        if local.size() != padded and any(t.size() != padded for t in inputs):
            raise ValueError(
                f"parameter {self.fqn!r} of size {tuple(self.info.global_size)} is unevenly "
                f"sharded over {self.info.world_size} ranks, so its fsdp_pre_all_gather must "
                f"return all-gather inputs of the padded sharded size {tuple(padded)}, got "
                f"{[tuple(t.size()) for t in inputs]}: pad dim 0 in the hook"
            )
        return inputs, metadata

    def post_all_gather(
        self, local: torch.Tensor, outputs: Sequence[torch.Tensor], metadata: object
    ) -> torch.Tensor:
        """Calls the post hook; returns the unsharded parameter at its original size."""
        unsharded, _ = self.post_hook(local, tuple(outputs), metadata, self.info.param_dtype)
        size, stride = self.info.global_size, self.global_stride
        if unsharded.size() != size or unsharded.stride() != stride:
            unsharded = torch.as_strided(unsharded, size, stride, storage_offset=0)
        elif comm.use_traced_path():
            # Traced, the parameter is a view of its own, never the hook's tensor itself
            # (the hook also returns that tensor among those it keeps). On torch 2.11,
            # where the hook's tensor needs no narrowing (one rank: no padding), Dynamo's
            # trace of the unshard's autograd.Function returns that tensor once for two
            # outputs, and the parameter's gradient comes back as zeros (2.13 is right).
            unsharded = unsharded.view(size)
        return unsharded

    def input_info(self, input_size: torch.Size, dtype: torch.dtype) -> ShardInfo:
        """The all-gather layout of one pre-hook input: gathered along dim 0, or for a
        ``Shard(d > 0)`` parameter, as FSDP2 does, laid out as the padded shard and
        concatenated along ``d``."""
        info = self.info
        if info.shard_dim == 0:
            sharded = torch.Size(input_size) if len(input_size) else torch.Size([1])
            global_size = torch.Size([info.world_size * sharded[0], *sharded[1:]])
        else:
            sharded = info.padded_sharded_size
            if sharded.numel() != torch.Size(input_size).numel():
                raise ValueError(
                    f"parameter {self.fqn!r} is sharded on dim {info.shard_dim}, so each "
                    f"input fsdp_pre_all_gather returns must have the padded sharded "
                    f"numel {sharded.numel()} ({tuple(sharded)}), got {tuple(input_size)}"
                )
            global_size = list(sharded)
            global_size[info.shard_dim] *= info.world_size
            global_size = torch.Size(global_size)
        return ShardInfo(
            global_size=global_size, shard_dim=info.shard_dim, world_size=info.world_size,
            rank=info.rank, sharded_size=sharded, padded_sharded_size=sharded,
            contiguous_sharded_stride=contiguous_strides(sharded),
            param_dtype=dtype, reduce_dtype=dtype, orig_dtype=dtype,
        )


def detect_extension(
    fqn: str,
    local: torch.Tensor,
    info: ShardInfo,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    module: nn.Module | None = None,
) -> AllGatherExtension | None:
    """The parameter's :class:`AllGatherExtension` as its local tensor stands now, or
    ``None`` for a tensor without hooks.

    Args:
        fqn: the parameter's name, for errors.
        local: the sharded parameter's local tensor.
        info: its :class:`ShardInfo`.
        mesh: the ``fully_shard`` mesh (the hooks get its shard dim).
        mp_policy: the group's mixed-precision policy (passed to the pre hook).
        module: the first module holding the parameter (passed to the pre hook).

    Returns:
        The extension record, or ``None`` when ``local`` has neither hook.

    Raises:
        TypeError: only one hook is defined, or the pre hook takes neither 1 nor 5
            arguments.
        ValueError: a 2-D mesh without dim names (the hooks get the shard sub-mesh).
    """
    pre = _hook_function(local, _PRE_HOOK)
    post = _hook_function(local, _POST_HOOK)
    if pre is None and post is None:
        return None
    if pre is None or post is None:
        missing = "fsdp_post_all_gather" if pre is not None else "fsdp_pre_all_gather"
        raise TypeError(
            f"parameter {fqn!r}: its local tensor {type(local).__name__} defines only one "
            f"of fsdp_pre_all_gather / fsdp_post_all_gather: define {missing} too, or neither"
        )
    pre_hook, num_args = pre
    if num_args not in (1, 5):
        raise TypeError(
            f"parameter {fqn!r}: {type(local).__name__}.fsdp_pre_all_gather takes "
            f"{num_args} arguments; FSDP calls {_PRE_HOOK_SIGNATURE} (or the older "
            "fsdp_pre_all_gather(self, mesh))"
        )
    if mesh.ndim == 1:
        shard_mesh = mesh
    elif mesh.mesh_dim_names is not None:
        shard_mesh = mesh[mesh.mesh_dim_names[-1]]
    else:
        raise ValueError(
            f"parameter {fqn!r} all-gathers through fsdp_pre_all_gather, which receives "
            "the shard mesh: give the 2-D mesh dim names (init_device_mesh(..., "
            "mesh_dim_names=('replicate', 'shard')))"
        )
    return AllGatherExtension(
        fqn, info, pre_hook, post[0], num_args == 1, shard_mesh, mp_policy, module)


def plain_without_hooks(local: torch.Tensor) -> bool:
    """Whether ``local`` is a plain tensor without hooks bound onto it, for which
    :func:`detect_extension` returns ``None``: the common case, answered in a few
    bytecodes where Dynamo traces it."""
    return (type(local) is torch.Tensor and not hasattr(local, _PRE_HOOK)
            and not hasattr(local, _POST_HOOK))


def plain_without_hooks_all(locals_: Sequence[torch.Tensor]) -> bool:
    """Whether every one of ``locals_`` is :func:`plain_without_hooks`: one frame where
    Dynamo traces it, not one per tensor."""
    for local in locals_:
        if (type(local) is not torch.Tensor or hasattr(local, _PRE_HOOK)
                or hasattr(local, _POST_HOOK)):
            return False
    return True


def _hook_function(local: torch.Tensor, name: str) -> tuple[Callable[..., object], int] | None:
    """Hook ``name`` of ``local`` as (a function taking the tensor first, the number of
    arguments FSDP passes it), or ``None`` where ``local`` has no such hook.

    A method (of the subclass, or bound onto this tensor) gives its function; another
    callable set on the tensor is called without it, as FSDP2 calls it.
    """
    if hasattr(local, name):
        hook = getattr(local, name)
        if inspect.ismethod(hook) and hook.__self__ is local:
            return hook.__func__, len(inspect.signature(hook.__func__).parameters) - 1
        return (functools.partial(_call_without_tensor, hook),
                len(inspect.signature(hook).parameters))
    # Traced, Dynamo answers hasattr on a tensor subclass from the plain tensor it
    # traces: a method of the subclass is found on the class.
    hook = getattr(type(local), name, None)
    if hook is None:
        return None
    return hook, len(inspect.signature(hook).parameters) - 1


def _call_without_tensor(hook: Callable[..., object], local: torch.Tensor,
                         *args: object) -> object:
    return hook(*args)


class AllGatherInputs(NamedTuple):
    """A group's all-gather inputs: one or several per parameter, with their layouts."""

    tensors: list[torch.Tensor]
    infos: list[ShardInfo]
    # Each input's size as its pre hook returned it (the post hook's views use it).
    input_sizes: list[torch.Size]
    # Per parameter: how many of ``tensors`` it contributed, the pre hook's metadata
    # (None for a plain parameter), the local tensor whose post hook rebuilds it, and
    # the extension (or None) whose pre hook ran: its post hook finishes this all-gather.
    counts: list[int]
    metadata: list[object]
    locals: list[torch.Tensor]
    extensions: list[AllGatherExtension | None]


@torch.no_grad()
def all_gather_inputs(
    sharded_locals: Sequence[torch.Tensor],
    infos: Sequence[ShardInfo],
    extensions: Sequence[AllGatherExtension | None],
) -> AllGatherInputs:
    """Runs the pre hooks: the tensors to all-gather for a group with extensions.

    Args:
        sharded_locals: the parameters' local shards.
        infos: their :class:`ShardInfo` s.
        extensions: per parameter, its extension or ``None``.

    Returns:
        The inputs, with one :class:`ShardInfo` each, and what the post hooks need.
    """
    tensors: list[torch.Tensor] = []
    input_infos: list[ShardInfo] = []
    input_sizes: list[torch.Size] = []
    counts: list[int] = []
    metadata: list[object] = []
    for local, info, extension in zip(sharded_locals, infos, extensions):
        if extension is None:
            tensors.append(local)
            input_infos.append(info)
            input_sizes.append(local.size())
            counts.append(1)
            metadata.append(None)
            continue
        inputs, meta = extension.pre_all_gather(local)
        for tensor in inputs:
            input_info = extension.input_info(tensor.size(), tensor.dtype)
            tensors.append(tensor.reshape(input_info.sharded_size))
            input_infos.append(input_info)
            input_sizes.append(tensor.size())
        counts.append(len(inputs))
        metadata.append(meta)
    return AllGatherInputs(tensors, input_infos, input_sizes, counts, metadata,
                           list(sharded_locals), list(extensions))


@torch.no_grad()
def unsharded_from_outputs(
    outputs: Sequence[torch.Tensor],
    gathered: AllGatherInputs,
) -> list[torch.Tensor]:
    """Runs the post hooks: one unsharded parameter per parameter of the group.

    Args:
        outputs: the copy-out's tensors, one per all-gather input.
        gathered: what :func:`all_gather_inputs` returned for this all-gather.

    Returns:
        The unsharded parameters, plain ones as the copy-out gave them.
    """
    unsharded: list[torch.Tensor] = []
    start = 0
    for count, meta, local, extension in zip(
        gathered.counts, gathered.metadata, gathered.locals, gathered.extensions
    ):
        pieces = outputs[start : start + count]
        if extension is None:
            unsharded.append(pieces[0])
        else:
            sizes = gathered.input_sizes[start : start + count]
            hook_outputs = [piece.view(-1, *size[1:]) for piece, size in zip(pieces, sizes)]
            unsharded.append(extension.post_all_gather(local, hook_outputs, meta))
        start += count
    return unsharded


class PendingUnshard(NamedTuple):
    """A group's all-gather in flight, and, with extensions, what its post hooks need."""

    result: AllGatherResult
    hook_inputs: AllGatherInputs | None
