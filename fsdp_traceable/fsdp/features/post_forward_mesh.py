"""``reshard_after_forward=N``: FSDP2's post-forward mesh and the piece each rank keeps
on it between forward and backward.

Between a group's forward and its backward each rank keeps ``1/N`` of the forward's
all-gather output instead of nothing; backward re-gathers it over the rank's group of
``N`` ranks (typically one node) instead of over the whole shard group. The gathered
buffer is the forward's all-gather output bit for bit, so the usual copy-out rebuilds
the same unsharded parameters.

[Note: the post-forward piece, compiled]
Eager, the group keeps the piece in its state from the forward's end to the backward.
A compiled graph keeps what its partitioner saves, so the unsharded parameters come out
of a recompute region (``autograd_bridge.unshard_params``) whose input is a piece and
whose body re-gathers it over the rank's ``N`` ranks and copies out; the backward re-runs
that body from the saved piece. The piece is gathered first, over the ranks at the same
position in every group of ``N`` (the mesh's other dimension): a two-step all-gather of
the same bytes as one over the shard group. Gathered so, the ``N`` pieces hold every
rank's copy-in position-major (rank ``g * N + p`` at ``[p][g]``); one copy puts them in
rank order for the usual copy-out, which then rebuilds the same bits.

Compiled autograd after an eager forward (per-block compile) traces the backward's
re-gather from the piece the eager forward kept (:meth:`PostForwardMesh.traced_regathered`),
over the rank's ``N`` ranks as the eager backward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ...collectives import AllGatherResult, comm
from ...collectives.all_gather import all_gather_output_copy_out
from ...collectives.bucket_layout import BucketLayout
from .all_gather_extensions import AllGatherInputs, PendingUnshard

if TYPE_CHECKING:  # FSDP2's comm interface, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather


class PostForwardMesh:
    """The groups of ``group_size`` ranks a parameter group reshards to after forward.

    Built at ``fully_shard`` time on every rank (it creates process groups), as FSDP2
    builds its post-forward mesh: the mesh's ranks, flattened, in rows of ``group_size``.
    """

    def __init__(self, mesh: DeviceMesh, group_size: int) -> None:
        self.group_size = group_size
        self.mesh = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, group_size))
        self.group = self.mesh.get_group(1)
        self.rank = self.mesh.get_local_rank(1)
        # The ranks of this rank's shard group at its position in every group of
        # group_size (see [Note: the post-forward piece, compiled]): the other dimension
        # of the mesh above on a 1-D mesh. On an HSDP mesh (replicate, shard) that
        # dimension would span the replicas; there they are each replica's own.
        if mesh.ndim == 1:
            self.across_groups = self.mesh.get_group(0)
        else:
            groups_per_shard = mesh.mesh.shape[-1] // group_size
            by_position = (mesh.mesh.reshape(-1, groups_per_shard, group_size)
                           .transpose(1, 2).reshape(-1, groups_per_shard))
            self.across_groups = DeviceMesh(mesh.device_type, by_position).get_group(1)

    def keep(self, gathered: PendingUnshard) -> KeptPiece:
        """This rank's ``1/group_size`` of a completed all-gather's output (a copy, so
        the full output can be freed), with what its copy-out needs."""
        output = gathered.result.pending.tensor
        piece = output.chunk(self.group_size)[self.rank].clone()
        return KeptPiece(piece, gathered.result.layout, gathered.hook_inputs)

    def traced_unsharded(self, piece: torch.Tensor, layout: BucketLayout) -> list[torch.Tensor]:
        """Traced: the unsharded parameters of ``layout``'s bucket from a piece gathered
        across the groups (see [Note: the post-forward piece, compiled])."""
        gathered = comm.wait(comm.all_gather(piece, self.group))
        # [position][group][copy-in] -> [group][position][copy-in]: rank order.
        groups = layout.world_size // self.group_size
        rank_ordered = gathered.view(self.group_size, groups, -1).transpose(0, 1)
        return all_gather_output_copy_out(rank_ordered.reshape(-1), layout)

    def traced_regathered(self, kept: KeptPiece) -> list[torch.Tensor]:
        """Traced: the unsharded parameters from a piece an eager forward kept (rank
        order already: no reorder, unlike :meth:`traced_unsharded`)."""
        gathered = comm.wait(comm.all_gather(kept.piece, self.group))
        return all_gather_output_copy_out(gathered, kept.layout)

    def regather(self, kept: KeptPiece, all_gather_comm: AllGather | None) -> PendingUnshard:
        """Starts the all-gather of the kept pieces that rebuilds the forward's output.

        Args:
            kept: what :meth:`keep` returned.
            all_gather_comm: the group's custom FSDP2 ``AllGather``, if set.

        Returns:
            An in-flight all-gather for ``ParamGroup.finish_all_gather``.
        """
        piece = kept.piece
        allocate = torch.empty if all_gather_comm is None else all_gather_comm.allocate
        output = allocate((piece.numel() * self.group_size,), dtype=piece.dtype,
                          device=piece.device)
        pending = comm.all_gather_into(output, piece, self.group, all_gather_comm)
        return PendingUnshard(AllGatherResult(pending, kept.layout, None), kept.hook_inputs)


class KeptPiece(NamedTuple):
    """A rank's piece of a forward all-gather output, kept until backward."""

    piece: torch.Tensor
    layout: BucketLayout
    hook_inputs: AllGatherInputs | None
