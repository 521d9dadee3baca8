"""Recompiles of a fully_shard-ed transformer's compiled train step, with the exact
counts a user's CI would pin and why each is expected.

The forward + loss is compiled with ``fullgraph=True``; where noted, the backward
runs under compiled autograd (``compiled_autograd._enable`` around ``loss.backward()``,
outside the compiled function, so no frames of torch's own backward machinery are
compiled). Single process on the fake process group, ``aot_eager`` backends. Changing
shapes, train/eval switches and several models per process, with numbers against
FSDP2: ``test_recipes.py``.
"""

from __future__ import annotations

import contextlib

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import DTensor

from compile_tests.sharded_model import data, make_model
from fsdp_traceable.testing import assert_no_recompiles, track_compiles


class Step:
    """A compiled forward + loss and, with ``compiled_autograd``, a compiled-autograd
    backward, each on its own counting backend."""

    def __init__(self, model, *, compiled_autograd: bool, dynamic: bool | None = None) -> None:
        self.model = model
        self.forward = CompileCounterWithBackend("aot_eager")
        self.backward = CompileCounterWithBackend("aot_eager")
        self.loss = torch.compile(model.loss, backend=self.forward, fullgraph=True,
                                  dynamic=dynamic)
        self.backward_compiler = torch.compile(backend=self.backward, fullgraph=True)
        self.compiled_autograd = compiled_autograd
        self.optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def backward_context(self):
        if not self.compiled_autograd:
            return contextlib.nullcontext()
        return torch._dynamo.compiled_autograd._enable(self.backward_compiler)

    def microbatch(self, batch: int = 2, scale: float = 1.0) -> None:
        loss = self.loss(*data(batch))
        if scale != 1.0:
            loss = loss * scale
        with self.backward_context():
            loss.backward()

    def optimizer_step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()


def test_ten_steps_compile_once(fake_world: None) -> None:
    step = Step(make_model(), compiled_autograd=True)
    with assert_no_recompiles() as record:
        for _ in range(10):
            step.microbatch()
            step.optimizer_step()
    # One forward frame, one compiled-autograd backward graph: the optimizer updates
    # the sharded parameters in place, which changes no guard.
    assert step.forward.frame_count == 1
    assert step.backward.frame_count == 1
    assert record.compiled_autograd_captures == 1
    assert [frame.name for frame in record.frames] == ["loss", "forward"]
    assert record.graph_breaks.count == 0


def test_gradient_accumulation_two_microbatches(fake_world: None) -> None:
    step = Step(make_model(), compiled_autograd=True)
    with assert_no_recompiles(max_compiled_autograd_captures=2) as record:
        for _ in range(4):
            for _ in range(2):
                step.microbatch(scale=0.5)
            step.optimizer_step()
    # The forward does not depend on .grad: one frame for all 8 microbatches.
    assert step.forward.frame_count == 1
    # Two backward graphs, each captured once: after zero_grad() the first microbatch's
    # gradients are assigned to .grad (it is None), the second's are added to it.
    # Compiled autograd specializes on that, as it does for any model.
    assert record.compiled_autograd_captures == 2
    assert len(record.frames_named("forward")) == 2
    assert record.recompiles == []


def test_reshard_after_forward_true_and_false_models(fake_world: None) -> None:
    resharding = Step(make_model(reshard_after_forward=True), compiled_autograd=False)
    keeping = Step(make_model(reshard_after_forward=False), compiled_autograd=False)
    with track_compiles() as record:
        for _ in range(3):
            resharding.microbatch()
            keeping.microbatch()
    # One graph per model, each compiled once. Both models run Transformer.loss, one
    # code object, so Dynamo counts the second model's first compile as a recompile of
    # it (its guards on the first model's reshard_after_forward fail); after that each
    # model hits its own cache entry.
    assert resharding.forward.frame_count == 1
    assert keeping.forward.frame_count == 1
    assert len(record.recompiles) == 1
    assert "_reshard_after_forward" in record.recompiles[0].recompile_reason


def test_changing_batch_size_with_dynamic_true_compiles_once(fake_world: None) -> None:
    step = Step(make_model(), compiled_autograd=False, dynamic=True)
    with assert_no_recompiles() as record:
        for batch in (2, 3, 4, 5, 3):
            step.microbatch(batch)
            step.optimizer_step()
    # One frame compile for every batch size: the batch (and sequence) dims are
    # symbolic from the start.
    assert [frame.name for frame in record.frames] == ["loss"]
    # The sharded parameters keep static shapes: fully_shard's forward reads them
    # through their modules, which Dynamo treats as parameters.
    graph = step.forward.graphs[-1]
    placeholders = {n.name: n.meta["example_value"] for n in graph.graph.nodes
                    if n.op == "placeholder" and isinstance(n.meta.get("example_value"),
                                                            torch.Tensor)}
    params = [value for value in placeholders.values() if isinstance(value, DTensor)]
    assert len(params) == len(list(step.model.parameters()))
    assert all(isinstance(d, int) for value in params for d in value.shape)
    assert not isinstance(placeholders["l_tokens_"].shape[0], int)
