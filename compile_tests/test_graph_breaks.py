"""Graph breaks of a fully_shard-ed transformer under ``torch.compile``, as a user's CI
would pin them.

Single process on the fake process group (graph structure only). ``aot_eager``: the
breaks are decided by Dynamo, before any backend runs.
"""

from __future__ import annotations

import os
from collections import Counter

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

from compile_tests.sharded_model import N_GROUPS, data, make_model
from fsdp_traceable.testing import count_collectives, count_graph_breaks, track_compiles

BACKWARD_BREAK = "Unsupported Tensor.backward() call"
DTENSOR_SOURCE = os.path.join("torch", "distributed", "tensor", "_api.py")


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


def test_train_step_with_backward_inside_breaks_once_in_user_code(fake_world: None) -> None:
    model = make_model()
    counter = CompileCounterWithBackend("aot_eager")

    def train_step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, targets)
        loss.backward()
        return loss.detach()

    with track_compiles() as record:
        torch.compile(train_step, backend=counter)(*data())
    breaks = record.graph_breaks
    assert len(breaks.locations) == breaks.count
    in_step = [summary for summary, location in zip(breaks.summaries(), breaks.locations)
               if _file(location) == __file__]
    others = [location for location in breaks.locations if _file(location) != __file__]
    # The one break in the step itself: the fundamental Tensor.backward break. The
    # forward before it is one graph; the resume function after it has no tensor work.
    assert in_step == [BACKWARD_BREAK]
    assert sum(n for reason, n in counters["graph_break"].items()
               if reason.startswith(BACKWARD_BREAK)) == 1
    assert [frame.name for frame in record.frames].count("train_step") == 1
    assert count_collectives(counter.graphs[0])["all_gather"] == N_GROUPS
    # Every other break is in torch's DTensor: the eager loss.backward() runs while
    # Dynamo is active (it is inside the compiled function), so Dynamo compiles the
    # Python frames AOTAutograd's backward calls to wrap the sharded gradients as
    # DTensors (``DTensor.__tensor_unflatten__``, once per distinct parameter layout:
    # 4 here). None is in fsdp_traceable or the model. Compiling only the model
    # (previous test), or running backward under compiled autograd outside the
    # compiled function (test_recompiles.py), avoids them.
    assert len(others) == 4
    assert all(_file(location).endswith(DTENSOR_SOURCE) for location in others), others


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
    # Still exactly one break in the step: Tensor.backward. Compiled autograd traces
    # the DTensor gradient wrapping at capture time, with Dynamo active: two breaks in
    # DTensor's frames, none in fsdp_traceable or the model.
    in_step = [s for s, loc in zip(record.graph_breaks.summaries(), record.graph_breaks.locations)
               if _file(loc) == __file__]
    assert in_step == [BACKWARD_BREAK]
    others = [loc for loc in record.graph_breaks.locations if _file(loc) != __file__]
    assert len(others) == 2 and all(_file(loc).endswith(DTENSOR_SOURCE) for loc in others)
