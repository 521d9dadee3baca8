"""``reshard_after_forward=N``: FSDP2's post-forward sharded state, eager.

Between a group's forward and its backward each rank keeps ``1/N`` of the forward's
all-gather output instead of nothing; backward re-gathers it over the rank's group of
``N`` ranks (typically one node) instead of over the whole shard group. The gathered
buffer is the forward's all-gather output bit for bit, so the usual copy-out rebuilds
the same unsharded parameters.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..collectives import AllGatherResult, ShardInfo, comm
from .all_gather_extensions import AllGatherInputs, PendingUnshard


class PostForwardResharding:
    """The groups of ``group_size`` ranks a parameter group reshards to after forward.

    Built at ``fully_shard`` time on every rank (it creates process groups), as FSDP2
    builds its post-forward mesh: the mesh's ranks, flattened, in rows of ``group_size``.
    """

    def __init__(self, mesh: DeviceMesh, group_size: int) -> None:
        self.group_size = group_size
        self.mesh = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, group_size))
        self.group = self.mesh.get_group(1)
        self.rank = self.mesh.get_local_rank(1)

    def keep(self, gathered: PendingUnshard) -> KeptPiece:
        """This rank's ``1/group_size`` of a completed all-gather's output (a copy, so
        the full output can be freed), with what its copy-out needs."""
        output = gathered.result.pending.tensor
        piece = output.chunk(self.group_size)[self.rank].clone()
        return KeptPiece(piece, gathered.result.infos, gathered.hook_inputs)

    def regather(self, kept: KeptPiece) -> PendingUnshard:
        """Starts the all-gather of the kept pieces that rebuilds the forward's output.

        Args:
            kept: what :meth:`keep` returned.

        Returns:
            An in-flight all-gather for ``ParamGroup.finish_all_gather``.
        """
        output = kept.piece.new_empty(kept.piece.numel() * self.group_size)
        pending = comm.all_gather_into(output, kept.piece, self.group)
        return PendingUnshard(AllGatherResult(pending, kept.infos, None), kept.hook_inputs)


class KeptPiece(NamedTuple):
    """A rank's piece of a forward all-gather output, kept until backward."""

    piece: torch.Tensor
    infos: tuple[ShardInfo, ...]
    hook_inputs: AllGatherInputs | None
