"""One pipeline stage's training step, as a pipeline-parallel job runs it: the stage
module ``fully_shard``-ed on its data-parallel mesh, driven by
``torch.distributed.pipelining``'s ``PipelineStage`` and schedule on the fake process
group, so its microbatches, the activations each keeps for backward, its FSDP
collectives and its sends and receives are the real schedule's.

[Note: plan pipeline stages]
A plan of ``--pp P`` traces each kind of stage on the rank that runs it (stage ``s`` on
global rank ``s * world / P``, the ``(pp, ...)`` mesh's order): the first (embeddings),
one middle stage (stage 1, the one with the most blocks and, in 1F1B, the most
microbatches in flight among the middle ones) and the last (norm, output, loss). Each
is traced at 3 and 4 blocks (with 2, the first microbatch's backward peaks at another
point of the step) and extrapolated to its blocks under the model's own split
(:attr:`~.models.ModelSource.stage_blocks`), as a whole model is (``[Note: plan
extrapolation]``): a stage's blocks are identical and its schedule does not depend on
how many it holds.

The stage's input and output shapes are given to ``PipelineStage`` (static metadata):
on the fake process group a receive returns no data, so the metadata a stage would
learn from its neighbour at run time never arrives; torch's warm-up vote over the
pipeline group is skipped for the same reason (it only chooses static metadata here).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .models import ModelSource, ShardSettings
from .recorder import StepRecorder

__all__ = ["SCHEDULES", "PipelineRunner", "stage_rank"]

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def stage_rank(stage_index: int, world_size: int, pp: int) -> int:
    """The first global rank of pipeline stage ``stage_index`` (the mesh's ``pp``
    dimension is the outermost)."""
    return stage_index * (world_size // pp)


@contextlib.contextmanager
def _static_metadata() -> Iterator[None]:
    """Skips the schedule's warm-up vote (see [Note: plan pipeline stages]); torch
    versions without it build the stage from the static metadata as they are."""
    from torch.distributed.pipelining import schedules

    if not hasattr(schedules._PipelineSchedule, "_warmup_p2p"):
        yield
        return
    from torch.distributed.pipelining._utils import InferenceMode

    def warmup(self: Any, stages: list, has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    with mock.patch.object(schedules._PipelineSchedule, "_warmup_p2p", warmup):
        yield


class PipelineRunner:
    """Runs one stage's steps: ``runner(tokens, targets, recorder)``.

    Args:
        model: the stage module, parallelized, its parameters materialized (fake).
        source: the model kind (loss, example activations).
        stage_index: this stage.
        pp_group: the pipeline's process group (this rank's stage and the others).
        settings: ``pp``, microbatches and schedule.
        batch_size, seq_len: sequences per data-parallel rank and step, tokens each.
    """

    def __init__(self, model: nn.Module, source: ModelSource, stage_index: int,
                 pp_group: dist.ProcessGroup, settings: ShardSettings, batch_size: int,
                 seq_len: int) -> None:
        microbatches = settings.n_microbatches
        if batch_size % microbatches:
            raise ValueError(f"--batch-size {batch_size} (sequences per data-parallel rank) "
                             f"must divide into --microbatches {microbatches}: pass a "
                             "multiple of it")
        pp, micro = settings.pp, batch_size // microbatches
        self.first, self.last = stage_index == 0, stage_index == pp - 1
        self.source = source
        hidden = source.hidden(micro, seq_len, settings)
        inputs = torch.zeros(micro, seq_len, dtype=torch.long) if self.first else hidden
        outputs = (torch.empty(micro, seq_len, source.vocab_size, dtype=hidden.dtype,
                               requires_grad=True) if self.last else hidden)
        # With DTensor activations (tensor parallel) static metadata needs the gradients'
        # too: each the same as its tensor; the tokens and the loss have none. (torch
        # before 2.13 takes no gradient metadata, nor DTensors between stages.)
        grads = {}
        if "input_grads" in inspect.signature(PipelineStage).parameters:
            grads = {"input_grads": (None,) if self.first else hidden,
                     "output_grads": None if self.last else hidden}
        self.stage = PipelineStage(model, stage_index, pp, torch.device("cpu"),
                                   input_args=inputs, output_args=outputs, group=pp_group,
                                   **grads)
        self.schedule = SCHEDULES[settings.schedule](
            self.stage, n_microbatches=microbatches, loss_fn=source.stage_loss)
        self.recorder: StepRecorder | None = None
        # Forward and backward chunks interleave: each is labelled with its phase.
        for method, phase in (("forward_one_chunk", "forward"),
                              ("backward_one_chunk", "backward")):
            setattr(self.stage, method, self._in_phase(getattr(self.stage, method), phase))

    def _in_phase(self, run: Callable, phase: str) -> Callable:
        @functools.wraps(run)
        def labelled(*args: Any, **kwargs: Any) -> Any:
            if self.recorder is None:
                return run(*args, **kwargs)
            with self.recorder.phase(phase):
                return run(*args, **kwargs)
        return labelled

    def __call__(self, tokens: torch.Tensor, targets: torch.Tensor,
                 recorder: StepRecorder | None) -> None:
        """One step's forward and backward over the microbatches (no optimizer step)."""
        self.recorder = recorder
        phase = recorder.phase if recorder is not None else lambda _: contextlib.nullcontext()
        try:
            # Outside the chunks: sends, receives and, after the last backward chunk,
            # the stage's gradient reduction; all of it belongs with backward.
            with _static_metadata(), self.source.step_context(), phase("backward"):
                if self.first:
                    self.schedule.step(tokens)
                elif self.last:
                    self.schedule.step(target=targets, losses=[])
                else:
                    self.schedule.step()
        finally:
            self.recorder = None
