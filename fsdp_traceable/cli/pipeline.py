"""``train --pp P``: the built-in transformer cut into pipeline stages, each
``fully_shard``-ed on the data-parallel mesh, trained by ``torch.distributed.pipelining``'s
``ScheduleGPipe``."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

from ..fsdp import fully_shard
from ..models.transformer import Transformer, TransformerConfig, TransformerStage, shard_transformer

__all__ = ["PipelineStep", "build_pipeline"]


class PipelineStep:
    """One rank's pipeline stage and its schedule: ``step(tokens, targets)`` runs one
    training step's forward and backward over the schedule's microbatches and returns
    the loss on the last stage's ranks (``None`` on the others).

    Each microbatch's loss is divided by the number of microbatches
    (:func:`build_pipeline`), so the gradients the schedule accumulates are those of the
    whole batch's mean loss, as without a pipeline.
    """

    def __init__(self, stage: TransformerStage, schedule: ScheduleGPipe) -> None:
        self.stage = stage
        self.schedule = schedule

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        if self.stage.is_first:
            self.schedule.step(tokens)
            return None
        if not self.stage.is_last:
            self.schedule.step()
            return None
        losses: list[torch.Tensor] = []
        self.schedule.step(target=targets, losses=losses)
        return torch.stack(losses).sum()


def build_pipeline(config: TransformerConfig, pp: int, microbatches: int, device: str,
                   mp_policy: MixedPrecisionPolicy, seed: int) -> tuple[PipelineStep, int, int]:
    """This rank's stage of a ``(pp, dp)`` mesh over every rank: the transformer built
    from ``seed`` (the same model on every rank), cut into ``pp`` stages, this rank's
    ``fully_shard``-ed per block and at the stage on ``dp``.

    Returns:
        The :class:`PipelineStep`, this rank's dp rank and the dp size.
    """
    world_size = dist.get_world_size()
    mesh = init_device_mesh(device, (pp, world_size // pp), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_mesh = mesh["pp"].get_local_rank(), mesh["dp"]
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(config)
    stage_module = shard_transformer(TransformerStage(model, pp_rank, pp), fully_shard,
                                     mesh=dp_mesh, mp_policy=mp_policy)
    stage = PipelineStage(stage_module, pp_rank, pp, torch.device(device),
                          group=mesh["pp"].get_group())
    schedule = ScheduleGPipe(stage, n_microbatches=microbatches,
                             loss_fn=_microbatch_loss(microbatches))
    return PipelineStep(stage_module, schedule), dp_mesh.get_local_rank(), dp_mesh.size()


def _microbatch_loss(microbatches: int) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()) / microbatches

    return loss
