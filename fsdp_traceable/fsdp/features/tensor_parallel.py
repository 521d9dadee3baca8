"""Parameters tensor parallel already made DTensors: FSDP shards their local tensors
on the dp mesh, laid out as FSDP2 lays them out.

[Note: TP parameters]
``parallelize_module`` turns a parameter into a DTensor on a TP mesh; ``fully_shard``
then shards that DTensor's local tensor (this rank's TP shard) on the dp mesh, as
FSDP2's ``FSDPParam._init_sharding_spec_tp`` does:

- the parameter's :class:`ShardInfo` describes the local tensor, so the bucketed
  collectives see plain local tensors only and gather on the dp mesh only;
- the sharded parameter is a DTensor on the SPMD mesh ``(dp..., tp)`` (FSDP2's
  ``_spmd_mesh``: the dp and TP meshes concatenated) with placements
  ``(Shard(d) or _StridedShard(d, split_factor=TP shards of d), *TP placements)``, an
  HSDP mesh adding ``Replicate()`` in front, and the TP parameter's global shape, so
  ``state_dict()`` and DCP checkpoints are FSDP2's;
- what forward computes with is the TP DTensor again: the all-gathered local tensor
  wrapped by ``DTensor.from_local`` on the TP mesh with the TP placements
  (:meth:`TensorParallelLayout.unsharded`). Its backward redistributes the gradient
  to those placements (e.g. an all-reduce of a ``Partial`` gradient of a replicated
  norm weight), as FSDP2's ``_get_grad_inner_tensor`` does before its reduce-scatter,
  and hands the reduce-scatter the plain local gradient.

Expert-parallel experts (torchtitan's ``ExpertParallel``: 3-D weights ``Shard(0)`` on an
``ep`` mesh, ``fully_shard``-ed on ``dp_shard_mod_ep``) take the same path: "TP mesh"
here means any mesh the parameter is a DTensor on that is not ``fully_shard``'s. Their
FSDP shard dim is dim 0 of the local experts (``_StridedShard(0, ...)``) or, with
``shard_placement_fn`` returning ``Shard(1)``, dim 1 (``Shard(1)``).

With ``fully_shard(mesh=spmd_mesh, dp_mesh_dims=...)`` (FSDP2's SPMD path, torch 2.12+)
every parameter is a DTensor on the whole mesh with ``Replicate()`` on the dp dims: the
sharded parameter keeps that mesh, its dp shard dim becoming ``Shard(d)`` or
``_StridedShard``; forward computes with the parameter's own DTensor layout, and
backward redistributes the gradient on the other dims only, leaving the dp dims (e.g.
``Partial`` from a batch sharded on dp) to the reduce-scatter, as FSDP2's
``_get_grad_inner_tensor`` does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from ...collectives import comm


@dataclass(frozen=True)
class TensorParallelLayout:
    """Where one TP parameter lives before and after ``fully_shard``.

    Attributes:
        tp_spec: the TP DTensor's spec (TP mesh, TP placements, global shape).
        spmd_mesh: the mesh of the sharded parameter: the dp mesh's dims, then the TP
            mesh's.
        spmd_placements: the sharded parameter's placements on ``spmd_mesh``.
    """

    tp_spec: DTensorSpec
    spmd_mesh: DeviceMesh
    spmd_placements: tuple[Placement, ...]
    # dp_mesh_dims only: the mesh dims whose gradient placement backward keeps.
    dp_dims: frozenset[int] = frozenset()

    def unsharded(self, local: torch.Tensor, grad_dtype: torch.dtype | None = None) -> DTensor:
        """The TP DTensor forward computes with, around the all-gathered ``local``
        (differentiable: see [Note: TP parameters]); its gradient in ``grad_dtype``
        (eager only; see [Note: wider gradient dtypes]) if given."""
        spec = self.tp_spec
        if grad_dtype is not None:
            return _KeepDataParallelGrad.apply(local, spec, self.dp_dims, grad_dtype)
        if self.dp_dims:
            if comm.use_traced_path():
                # AOTAutograd hands the Function's backward the gradient's local tensor
                # under the wrong layout ("invalid gradient ... got [8, 16] but expected
                # [8, 8]" on a (2, 2) mesh, torch 2.13).
                raise NotImplementedError(
                    "fully_shard(dp_mesh_dims=...) runs eagerly only: under torch.compile "
                    "pass mesh=mesh['dp'] with parameters that parallelize_module made "
                    "DTensors on mesh['tp'] instead"
                )
            return _KeepDataParallelGrad.apply(local, spec, self.dp_dims)
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)


class _KeepDataParallelGrad(torch.autograd.Function):
    """``DTensor.from_local`` whose backward redistributes the gradient to the
    parameter's placements on the non-dp dims only (see [Note: TP parameters]; all dims
    where ``dp_dims`` is empty), the gradient first cast to ``grad_dtype`` if given."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, dp_dims: frozenset[int],
                grad_dtype: torch.dtype | None = None) -> DTensor:
        ctx.spec, ctx.dp_dims = spec, dp_dims
        if grad_dtype is not None:
            ctx.set_output_grad_dtype(grad_dtype)
        return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                  shape=spec.shape, stride=spec.stride)

    @staticmethod
    def backward(ctx, grad: DTensor) -> tuple[torch.Tensor, None, None, None]:
        placements = tuple(grad.placements[i] if i in ctx.dp_dims else p
                           for i, p in enumerate(ctx.spec.placements))
        if placements != tuple(grad.placements):
            grad = grad.redistribute(placements=placements)
        return grad.to_local(), None, None, None


def tensor_parallel_layout(
    fqn: str, param: DTensor, dp_mesh: DeviceMesh, shard_dim: int
) -> TensorParallelLayout:
    """Checks a TP parameter and lays it out as FSDP2 does (see [Note: TP parameters]).

    Runs at ``fully_shard`` time, before any collective, on every rank alike.

    Args:
        fqn: the parameter's name, for messages.
        param: the parameter, a DTensor on a TP mesh.
        dp_mesh: ``fully_shard``'s mesh (1-D FSDP or 2-D HSDP).
        shard_dim: the dim of the local tensor FSDP shards.

    Returns:
        The parameter's layout.

    Raises:
        ValueError: the TP mesh is or overlaps the dp mesh (e.g. a parameter FSDP
            sharded already), is on another device type, or is not a slice of the mesh
            the dp mesh comes from; a placement is ``Partial``.
        NotImplementedError: more than 2 TP mesh dims (FSDP2's limit).
    """
    spec = param._spec
    tp_mesh = spec.mesh
    where = f"parameter {fqn!r} is a DTensor on mesh {tp_mesh}"
    dp_names, tp_names = dp_mesh.mesh_dim_names, tp_mesh.mesh_dim_names
    overlap = sorted(set(dp_names or ()) & set(tp_names or ()))
    if tp_mesh == dp_mesh or overlap:
        dims = f" (dims {overlap})" if overlap else ""
        raise ValueError(
            f"parameter {fqn!r} is already a DTensor (placements {tuple(spec.placements)}) on "
            f"fully_shard's mesh {dp_mesh}{dims}: is it sharded by FSDP already? "
            "fully_shard shards plain parameters, and tensor-parallel DTensors on other dims "
            "of the same mesh (e.g. mesh['tp'] with fully_shard(mesh=mesh['dp']))"
        )
    if tp_mesh.device_type != dp_mesh.device_type:
        raise ValueError(
            f"{where} of device type {tp_mesh.device_type!r}, but fully_shard's mesh is "
            f"{dp_mesh.device_type!r}: build both meshes on one device type"
        )
    if any(isinstance(p, Partial) for p in spec.placements):
        raise ValueError(
            f"{where} with placements {tuple(spec.placements)}: a Partial parameter holds "
            "a pending sum, which FSDP cannot shard; redistribute it to Replicate() or "
            "Shard(d) before fully_shard"
        )
    if len(spec.placements) > 2:
        raise NotImplementedError(
            f"{where} with {len(spec.placements)} dims: fully_shard supports parameters "
            "of 1-D tensor/expert parallel or 2-D expert + tensor parallel, as FSDP2"
        )
    if dp_names is None or tp_names is None:
        raise ValueError(
            f"{where}: composing FSDP with tensor parallel needs named mesh dims; slice "
            "both meshes from one init_device_mesh(..., mesh_dim_names=(...)) mesh, e.g. "
            "mesh['dp'] and mesh['tp']"
        )
    if tp_mesh._get_root_mesh() != dp_mesh._get_root_mesh():
        raise ValueError(
            f"{where}, not sliced from the mesh fully_shard's mesh {dp_mesh} comes from: "
            "slice both from one init_device_mesh mesh, e.g. mesh['dp'] and mesh['tp']"
        )
    spmd_mesh = _spmd_mesh(fqn, dp_mesh, tp_mesh)
    split_factor = spec.num_shards_map[shard_dim]
    dp_placement = (_StridedShard(shard_dim, split_factor=split_factor) if split_factor > 1
                    else Shard(shard_dim))
    hsdp = (Replicate(),) if dp_mesh.ndim == 2 else ()
    placements = (*hsdp, dp_placement, *spec.placements)
    return TensorParallelLayout(spec, spmd_mesh, placements)


def _spmd_mesh(fqn: str, dp_mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
    """The dp and TP meshes as one mesh, as FSDP2 builds it (no collective)."""
    concatenate = getattr(DeviceMesh, "_concatenate", None)
    if concatenate is not None:
        try:
            return concatenate([dp_mesh, tp_mesh])
        except RuntimeError as err:
            raise ValueError(
                f"parameter {fqn!r}: its tensor/expert-parallel mesh {tp_mesh} and "
                f"fully_shard's mesh {dp_mesh} do not form one mesh ({err}); fully_shard it "
                "on dims its mesh does not use, e.g. expert-parallel experts on "
                "dp_shard_mod_ep, not on the dense layers' dp mesh"
            ) from None
    # Older torch: the root mesh, when its dims are exactly dp's then TP's.
    root = dp_mesh._get_root_mesh()
    if root.mesh_dim_names != (*dp_mesh.mesh_dim_names, *tp_mesh.mesh_dim_names):
        raise NotImplementedError(
            f"parameter {fqn!r}: on this torch, the dp and TP meshes must be all the dims "
            f"of their root mesh, dp first; got {dp_mesh.mesh_dim_names} and "
            f"{tp_mesh.mesh_dim_names} of {root.mesh_dim_names}"
        )
    return root


def data_parallel_mesh(mesh: DeviceMesh, dp_mesh_dims: object) -> DeviceMesh:
    """FSDP2's dp mesh for ``fully_shard(mesh=mesh, dp_mesh_dims=...)``: the named shard
    dim (FSDP), or the replicate and shard dims (HSDP), each several dims flattened.

    Args:
        mesh: the full SPMD mesh the parameters are DTensors on.
        dp_mesh_dims: torch's ``DataParallelMeshDims``.

    Returns:
        The 1-D (FSDP) or 2-D (replicate, shard) dp mesh.

    Raises:
        ValueError: unnamed mesh dims, or a name not in the mesh.
        NotImplementedError: no shard dim (DDP), or several shard dims.
    """
    shard, replicate = tuple(dp_mesh_dims.shard_names), tuple(dp_mesh_dims.replicate_names)
    names = getattr(mesh, "mesh_dim_names", None)
    if names is None:
        raise ValueError("fully_shard(dp_mesh_dims=...) needs a DeviceMesh with mesh_dim_names")
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(
                f"dp_mesh_dims names mesh dim {name!r}, which is not in the mesh's dims {names}"
            )
    if len(shard) != 1:
        raise NotImplementedError(
            f"dp_mesh_dims={dp_mesh_dims!r}: fully_shard supports exactly one shard dim "
            "(DDP without one, and several flattened shard dims, are not supported yet)"
        )
    shard_mesh = mesh[shard[0]]
    if not replicate:
        return shard_mesh
    replicate_mesh = mesh[replicate[0]] if len(replicate) == 1 else mesh[replicate]._flatten(
        "_".join(replicate))
    return DeviceMesh._concatenate([replicate_mesh, shard_mesh])


def spmd_layout(
    fqn: str, param: object, spmd_mesh: DeviceMesh, dp_mesh_dims: object, shard_dim: int
) -> TensorParallelLayout:
    """A parameter's layout under ``dp_mesh_dims`` (see [Note: TP parameters]), checked
    as FSDP2 checks it, before any collective.

    Raises:
        ValueError: not a DTensor on ``spmd_mesh`` itself, or not ``Replicate()`` on a
            dp dim.
    """
    if not isinstance(param, DTensor):
        raise ValueError(
            f"parameter {fqn!r} is a plain tensor: with dp_mesh_dims, every parameter must "
            "be a DTensor on the full SPMD mesh (e.g. via distribute_module)"
        )
    spec = param._spec
    if spec.mesh != spmd_mesh:
        raise ValueError(
            f"parameter {fqn!r} is a DTensor on mesh {spec.mesh}, not on the mesh passed to "
            f"fully_shard ({spmd_mesh}); with dp_mesh_dims they must be the same mesh"
        )
    names = spmd_mesh.mesh_dim_names
    shard_index = names.index(dp_mesh_dims.shard_names[0])
    dp_dims = frozenset([shard_index, *(names.index(n) for n in dp_mesh_dims.replicate_names)])
    for i in sorted(dp_dims):
        if not isinstance(spec.placements[i], Replicate):
            raise ValueError(
                f"parameter {fqn!r} has placement {spec.placements[i]} on dp mesh dim "
                f"{names[i]!r}: with dp_mesh_dims, parameters must be Replicate() on every "
                "dp dim"
            )
    split_factor = 1
    for j in range(shard_index + 1, spmd_mesh.ndim):
        placement = spec.placements[j]
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == shard_dim:
            split_factor *= spmd_mesh.size(j)
    placements = list(spec.placements)
    placements[shard_index] = (_StridedShard(shard_dim, split_factor=split_factor)
                               if split_factor > 1 else Shard(shard_dim))
    return TensorParallelLayout(spec, spmd_mesh, tuple(placements), dp_dims)
