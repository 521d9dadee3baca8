"""Graph breaks of a fully_shard-ed transformer under ``torch.compile``, as a user's CI
would pin them.

Single process on the fake process group (graph structure only). ``aot_eager``: the
breaks are decided by Dynamo, before any backend runs.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from compile_tests.sharded_model import N_GROUPS, data, make_model
from fsdp_traceable.testing import count_collectives, count_graph_breaks, track_compiles

BACKWARD_BREAK = "Unsupported Tensor.backward() call"


def _file(location: str) -> str:
    return location.rsplit(":", 1)[0]


def test_whole_model_fullgraph_compiles_without_graph_breaks(fake_world: None) -> None:
    model = make_model()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    tokens, targets = data()

    def train_step() -> None:
        logits = compiled(tokens)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()

    breaks = count_graph_breaks(train_step)
    # fullgraph=True would raise on a break; the counters confirm none was recorded
    # anywhere, including frames entered during the eager backward.
    assert breaks.count == 0, breaks.reasons
    assert not counters["graph_break"]
    assert counter.frame_count == 1


def test_train_step_with_backward_inside_breaks_once(fake_world: None) -> None:
    model = make_model()
    counter = CompileCounterWithBackend("aot_eager")

    def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, targets)
        loss.backward()
        return loss.detach()

    with track_compiles() as record:
        torch.compile(train_step, backend=counter)(*data())
    breaks = record.graph_breaks
    # Exactly one break, in the step itself: the fundamental Tensor.backward break.
    # The forward before it is one graph; the resume function after it has no tensor
    # work. The eager loss.backward() runs while Dynamo is active (it is inside the
    # compiled function), yet no frame it enters (fsdp_traceable's backward, DTensor's
    # gradient wrapping) adds a break.
    assert breaks.count == 1
    assert [_file(location) for location in breaks.locations] == [__file__]
    assert breaks.summaries() == [BACKWARD_BREAK]
    assert [(reason.splitlines()[0], n) for reason, n in counters["graph_break"].items()] == [
        (BACKWARD_BREAK, 1)
    ]
    assert [frame.name for frame in record.frames].count("train_step") == 1
    assert count_collectives(counter.graphs[0])["all_gather"] == N_GROUPS


def test_compiled_autograd_train_step_is_one_forward_and_one_backward_graph(
    fake_world: None,
) -> None:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    counter = CompileCounterWithBackend("aot_eager")

    def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, targets)
        loss.backward()
        return loss.detach()

    # The documented switch: compiled autograd for backward calls made inside
    # functions compiled while it is set.
    with torch._dynamo.config.patch(compiled_autograd=True):
        compiled_step = torch.compile(train_step, backend=counter)
        with track_compiles() as record:
            for _ in range(3):
                compiled_step(*data())
                optimizer.step()
                optimizer.zero_grad()
    graphs_by_frame = Counter(frame.name for frame in record.frames)
    # One forward graph (the train_step frame up to loss.backward()) and one compiled-
    # autograd backward graph (a frame named "forward" of compiled autograd's graph
    # module), captured once and reused by the later steps.
    assert graphs_by_frame["train_step"] == 1
    assert graphs_by_frame["forward"] == 1
    assert record.compiled_autograd_captures == 1
    assert not [f for f in record.recompiles if f.name in ("train_step", "forward")]
    # Still exactly one break: Tensor.backward. Compiled autograd captures the
    # backward, DTensor gradient wrapping included, with Dynamo active; that adds none.
    assert record.graph_breaks.summaries() == [BACKWARD_BREAK]
    assert [_file(loc) for loc in record.graph_breaks.locations] == [__file__]
