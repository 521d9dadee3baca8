"""Per-block compile (``block.compile(fullgraph=True)`` on every block, as torchtitan
does) of a fully_shard-ed transformer, backward under compiled autograd.

Identical blocks share one compiled forward graph: Dynamo reaches each block's sharded
parameters through its module (graph inputs, not constants) and guards on nothing
that differs between blocks, so compile work stays constant in depth. Each block's
graph holds its group's all-gather (and, in backward, the reduce-scatter and the
re-gather of reshard-after-forward). Compiled autograd pastes each block's backward
as one call of a shared region (``fsdp_traceable.backward_regions``), so the backward
is traced and compiled once too, with every block's collectives outside the region.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections import Counter

import torch
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_traceable
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)
from fsdp_traceable.testing import count_collectives, track_compiles
from tests.fsdp.parity_utils import full_params, shard_copies


def _config(n_layers: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=96, dim=48, n_layers=n_layers, n_heads=4, hidden_dim=80,
                             max_seq_len=12)


# Dynamo reuses a nested compile region's trace across calls (torch 2.13+).
_DYNAMO_REUSES_SUBGRAPHS = (
    importlib.util.find_spec("torch._dynamo.variables.invoke_subgraph") is not None)


def _model(n_layers: int) -> Transformer:
    torch.manual_seed(0)
    return shard_transformer(Transformer(_config(n_layers)), fsdp_traceable.fully_shard)


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    return tokens, torch.roll(tokens, 1, dims=1)


def _compile_blocks(model: Transformer, backend) -> None:
    for block in model.layers:
        block.compile(backend=backend, fullgraph=True)


def _train(model: Transformer, steps: int, backward_compiler=None) -> list[float]:
    return _train_on_batches(model, [_data() for _ in range(steps)], backward_compiler)


def _train_on_batches(model: Transformer, batches: list[tuple[torch.Tensor, torch.Tensor]],
                      backward_compiler=None) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for batch in batches:
        loss = model.loss(*batch)
        context = (torch._dynamo.compiled_autograd._enable(backward_compiler)
                   if backward_compiler is not None else contextlib.nullcontext())
        with context:
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_one_block_graph_for_any_depth(fake_world: None) -> None:
    for n_layers in (2, 3):
        torch._dynamo.reset()
        model = _model(n_layers)
        forward = CompileCounterWithBackend("aot_eager")
        _compile_blocks(model, forward)
        with track_compiles() as record:
            _train(model, 2)
        # Every block runs the one graph (and its one AOT backward).
        assert forward.frame_count == 1, n_layers
        assert [frame.name for frame in record.frames] == ["forward"]
        assert record.graph_breaks.count == 0, record.graph_breaks.reasons
        # The eager root does not prefetch for the compiled blocks, which gather themselves.
        assert all(not block._fsdp_group.has_prefetch for block in model.layers)


def _region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each ``invoke_subgraph`` of ``gm`` calls, in order."""
    return [str(n.args[0].target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph]


def test_compiled_autograd_traces_one_block_backward(fake_world: None) -> None:
    n_layers = 3
    model = _model(n_layers)
    _compile_blocks(model, "aot_eager")
    backward = CompileCounterWithBackend("aot_eager")
    with track_compiles() as record:
        _train(model, 2, torch.compile(backend=backward, fullgraph=True))
    assert record.graph_breaks.count == 0, record.graph_breaks.reasons
    assert record.recompiles == []
    (graph,) = backward.graphs
    # Every block calls the one region. Dynamo with subgraph reuse (torch 2.13+) traces
    # it once; older Dynamo traces every call and keeps one graph per distinct trace,
    # where the first can differ from the rest: two subgraphs, for any depth.
    calls = _region_calls(graph)
    assert len(calls) == n_layers
    if _DYNAMO_REUSES_SUBGRAPHS:
        assert len(set(calls)) == 1
    else:
        assert len(set(calls[1:])) == 1 and len(set(calls)) <= 2
    region = getattr(graph, calls[0])
    assert count_collectives(region) == Counter()
    # The collectives are all in the outer graph: each block's re-gather and
    # reduce-scatter, and the root's reduce-scatter.
    assert count_collectives(graph) == Counter(
        all_gather=n_layers, reduce_scatter=n_layers + 1, wait=2 * n_layers + 1)


def test_without_backward_regions_every_block_backward_is_pasted(fake_world: None) -> None:
    model = _model(2)
    _compile_blocks(model, "aot_eager")
    backward = CompileCounterWithBackend("aot_eager")
    with fsdp_traceable.config.patch(backward_regions=False):
        _train(model, 1, torch.compile(backend=backward, fullgraph=True))
    (graph,) = backward.graphs
    assert _region_calls(graph) == []
    assert count_collectives(graph)["reduce_scatter"] == 3


def test_per_block_compile_matches_eager(one_gloo_rank: None) -> None:
    eager, compiled = _model(2), _model(2)
    forward = CompileCounterWithBackend("aot_eager")
    _compile_blocks(compiled, forward)
    expected = _train(eager, 2)
    backward = CompileCounterWithBackend("aot_eager")
    with track_compiles() as record:
        # Backward: compiled autograd's one graph for the whole model.
        losses = _train(compiled, 2, torch.compile(backend=backward, fullgraph=True))
    assert forward.frame_count == 1
    assert record.recompiles == []
    assert record.graph_breaks.count == 0, record.graph_breaks.reasons
    assert record.compiled_autograd_captures == 1
    assert len(_region_calls(backward.graphs[0])) == 2  # the blocks' backward: regions
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    for ours, reference in zip(compiled.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.full_tensor(), reference.full_tensor(),
                                   rtol=0, atol=1e-5)


# -- dynamic shapes: changing sequence lengths, then a second model -------------------


def _dynamic_config(dim: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=64, dim=dim, n_layers=2, n_heads=4, max_seq_len=16)


def _batch(step: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(10 + step)
    tokens = torch.randint(0, 64, (2, seq_len), generator=generator)
    return tokens, torch.randint(0, 64, (2, seq_len), generator=generator)


def _train_on(model: Transformer, seq_lens: list[int], backward_compiler=None) -> list[float]:
    batches = [_batch(step, seq_len) for step, seq_len in enumerate(seq_lens)]
    return _train_on_batches(model, batches, backward_compiler)


def test_per_block_compile_with_changing_shapes_matches_fsdp2(one_gloo_rank: None) -> None:
    """Backwards with symbolic sizes are outlined and train with FSDP2's numbers: a
    sequence length that changes (16, 12, 16), then a second model of another width,
    whose recompiled block Dynamo makes dynamic in the width (automatic dynamic
    shapes), in the same process."""
    forward = CompileCounterWithBackend("aot_eager")
    backward = CompileCounterWithBackend("aot_eager")
    backward_compiler = torch.compile(backend=backward, fullgraph=True)
    with track_compiles() as record:
        for dim, seq_lens in ((32, [16, 12, 16]), (16, [16])):
            torch.manual_seed(0)
            theirs, ours = shard_copies(Transformer(_dynamic_config(dim)))
            _compile_blocks(ours, forward)
            expected = _train_on(theirs, seq_lens)
            losses = _train_on(ours, seq_lens, backward_compiler)
            torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
            for mine, reference in zip(full_params(ours), full_params(theirs)):
                torch.testing.assert_close(mine, reference, rtol=0, atol=1e-5)
    assert record.graph_breaks.count == 0, record.graph_breaks.reasons
    # Block forward graphs: seq 16 (static); seq 12 fails the shape guard and Dynamo
    # recompiles with the sequence dim dynamic, which serves seq 16 again; the second
    # model fails the guards on its parameters' shapes: one graph dynamic in the width.
    assert forward.frame_count == 3
    # Compiled autograd captures a backward per distinct AOT backward it meets: the
    # static block graph's, the dynamic one's, the second model's.
    assert record.compiled_autograd_captures == 3
    # Dynamo compiles of those captures: one each, plus one when the dynamic block's
    # capture, first compiled at seq 12, meets seq 16 (automatic dynamic again).
    assert backward.frame_count == 4
    # The static backward pastes both blocks as calls of the one region. (Dynamo inlines
    # the symbolic ones back: each call's SymInt arguments are its own objects, so no
    # call reuses another's trace, and a region called once is inlined.)
    assert len(_region_calls(backward.graphs[0])) == 2
