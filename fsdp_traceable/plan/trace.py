"""One training step of a model, run on fake tensors on a fake process group and recorded.

Why run the eager step rather than trace a graph: ``fully_shard``'s eager path is the
one whose memory a training job sees (it frees each block's unsharded parameters after
forward and gathers them again in backward), and it runs unchanged on fake tensors
(``FakeTensorMode``: shapes, dtypes and storages, no data) with torch's fake process
group, whose collectives return at once. Every op the fake mode runs is shown to the
:class:`~.recorder.StepRecorder`, so the step's allocations, frees and collectives are
the real step's, op for op; nothing is allocated (a 405B block at its real sizes costs
kilobytes). torch's ``MemTracker`` / ``FSDPMemTracker`` were the alternative: the first
labels by module and knows no ``fully_shard`` of ours, the second reaches into torch's
own FSDP2 state, so the recorder does the same counting with this package's labels.

The step is ``loss.backward()``, ``optimizer.step()`` and ``zero_grad()``; it runs
twice, the second recorded, so the optimizer state exists before it as in any step
after the first.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from .models import ModelSource, ShardSettings, plan_meshes
from .recorder import GRADIENTS, OPTIMIZER, PARAMS, PERSISTENT, RecordingFakeMode, StepRecorder

__all__ = ["StepTrace", "fake_world", "trace_step"]

# ``step(tokens, targets, recorder)``: one step's forward and backward.
ForwardBackward = Callable[[torch.Tensor, torch.Tensor, "StepRecorder | None"], None]


@dataclass(frozen=True)
class Workload:
    """The data and optimizer of a step."""

    batch_size: int = 8  # sequences per data-parallel rank
    seq_len: int = 64
    optimizer: str = "adamw"
    lr: float = 1e-3


@dataclass
class StepTrace:
    """A recorded step at one depth.

    Attributes:
        depth: blocks in the traced model.
        recorder: what the step allocated and issued.
        params_bytes: this rank's sharded parameters.
        optimizer_bytes: this rank's optimizer state.
        gradient_bytes: this rank's sharded gradients after backward.
        flops: this rank's FLOPs (``torch.utils.flop_counter``'s formulas).
        baseline_bytes: what was alive on the rank when the step started.
    """

    depth: int
    recorder: StepRecorder
    params_bytes: int
    optimizer_bytes: int
    gradient_bytes: int
    flops: int
    baseline_bytes: int


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """Rank ``rank`` of ``world_size`` ranks on torch's fake process group (no data
    moves)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
        _forget_sharding()


def _forget_sharding() -> None:
    """Clears DTensor's sharding-propagation caches: their entries hold the meshes of
    the world just destroyed, which compare equal to the next world's meshes (same
    shape and names), so a later trace on another rank would be handed a mesh whose
    process groups no longer exist."""
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
    except ImportError:  # torch without it: nothing cached across worlds to clear
        return
    _clear_sharding_prop_cache()


def make_optimizer(name: str, params: Iterator[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW or SGD as a GPU job runs them: foreach (multi-tensor) updates."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    return torch.optim.AdamW(params, lr=lr, foreach=True)


def _storage_bytes(tensors: Iterator[torch.Tensor]) -> int:
    seen: dict[int, int] = {}
    for tensor in tensors:
        local = getattr(tensor, "_local_tensor", tensor)
        storage = local.untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return sum(seen.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def forward_backward(model: nn.Module, source: ModelSource) -> ForwardBackward:
    """The step's forward and ``loss.backward()`` on the whole model."""
    def run(tokens: torch.Tensor, targets: torch.Tensor, recorder: StepRecorder | None) -> None:
        phase = recorder.phase if recorder is not None else lambda _: contextlib.nullcontext()
        with source.step_context():
            with phase("forward"):
                loss = source.loss(model, tokens, targets)
            with phase("backward"):
                loss.backward()
            del loss
    return run


def run_step(model: nn.Module, step: ForwardBackward, optimizer: torch.optim.Optimizer,
             tokens: torch.Tensor, targets: torch.Tensor,
             recorder: StepRecorder | None = None) -> int:
    """One step; with a ``recorder``, recorded phase by phase. Returns the sharded
    gradients' bytes after backward."""
    phase = recorder.phase if recorder is not None else lambda _: contextlib.nullcontext()
    step(tokens, targets, recorder)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if recorder is not None:
        recorder.relabel(grads, GRADIENTS)
    gradient_bytes = _storage_bytes(grads)
    del grads
    with phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad()
    return gradient_bytes


def trace_step(source: ModelSource, depth: int, world_size: int, settings: ShardSettings,
               workload: Workload, stage_index: int | None = None) -> StepTrace:
    """Builds ``source`` with ``depth`` blocks on ``world_size`` fake ranks, parallelizes
    it, and records its second training step on fake tensors.

    Args:
        source: the model.
        depth: blocks to build (of the stage, with ``stage_index``).
        world_size: ranks (data parallel x tensor parallel x pipeline stages).
        settings: the parallelism set-up.
        workload: batch, sequence length and optimizer.
        stage_index: with ``settings.pp > 1``, the pipeline stage to trace (see
            [Note: plan pipeline stages]).

    Returns:
        The recorded step of rank 0 (of the stage's first rank).
    """
    from .pipeline import PipelineRunner, stage_rank

    pipelined = stage_index is not None
    rank = stage_rank(stage_index, world_size, settings.pp) if pipelined else 0
    with fake_world(world_size, rank):
        if pipelined:
            model = source.build_stage(depth, stage_index == 0, stage_index == settings.pp - 1)
        else:
            model = source.build(depth)
        model = source.parallelize(model, world_size, settings)
        pp_group = plan_meshes(world_size, settings)["pp"].get_group() if pipelined else None
        fake_mode = RecordingFakeMode(allow_non_fake_inputs=True)
        with fake_mode:
            model.to_empty(device="cpu")
            optimizer = make_optimizer(workload.optimizer, model.parameters(), workload.lr)
            shape = (workload.batch_size, workload.seq_len)
            tokens = torch.randint(0, source.vocab_size, shape)
            targets = torch.randint(0, source.vocab_size, shape)
            step = (PipelineRunner(model, source, stage_index, pp_group, settings,
                                   workload.batch_size, workload.seq_len)
                    if pipelined else forward_backward(model, source))
            run_step(model, step, optimizer, tokens, targets)  # creates optimizer state
            recorder = StepRecorder()
            recorder.name_groups(model)
            recorder.adopt(model.parameters(), PARAMS)
            recorder.adopt(_optimizer_tensors(optimizer), OPTIMIZER)
            recorder.adopt(model.buffers(), PERSISTENT)
            recorder.adopt((tokens, targets), PERSISTENT)
            baseline_bytes = recorder.current
            fake_mode.recorder = recorder
            try:
                gradient_bytes = run_step(model, step, optimizer, tokens, targets, recorder)
            finally:
                fake_mode.recorder = None
        params_bytes = _storage_bytes(model.parameters())
        optimizer_bytes = _storage_bytes(_optimizer_tensors(optimizer))
    return StepTrace(depth, recorder, params_bytes, optimizer_bytes, gradient_bytes,
                     recorder.flops, baseline_bytes)
