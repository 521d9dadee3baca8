"""Per-block compile (``block.compile(fullgraph=True)`` on every block, as torchtitan
does) of a fully_shard-ed transformer, backward under compiled autograd.

Identical blocks share one compiled forward graph: Dynamo reaches each block's sharded
parameters through its module (graph inputs, not constants) and guards on nothing
that differs between blocks, so compile work stays constant in depth. Each block's
graph holds its group's all-gather (and, in backward, the reduce-scatter and the
re-gather of reshard-after-forward).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import fsdp_traceable
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)
from fsdp_traceable.testing import track_compiles


def _config(n_layers: int) -> TransformerConfig:
    return TransformerConfig(vocab_size=96, dim=48, n_layers=n_layers, n_heads=4, hidden_dim=80,
                             max_seq_len=12)


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
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        loss = model.loss(*_data())
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
        assert all(block._fsdp_group.eager.prefetched is None for block in model.layers)


@contextlib.contextmanager
def _one_gloo_rank(tmp_path) -> Iterator[None]:
    """A real one-rank gloo group: the fake group's collectives carry no data."""
    store = dist.FileStore(os.path.join(tmp_path, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def test_per_block_compile_matches_eager(tmp_path) -> None:
    with _one_gloo_rank(tmp_path):
        eager, compiled = _model(2), _model(2)
        forward = CompileCounterWithBackend("aot_eager")
        _compile_blocks(compiled, forward)
        expected = _train(eager, 2)
        with track_compiles() as record:
            # Backward: compiled autograd's one graph for the whole model.
            losses = _train(compiled, 2, torch.compile(backend="aot_eager", fullgraph=True))
        assert forward.frame_count == 1
        assert record.recompiles == []
        assert record.graph_breaks.count == 0, record.graph_breaks.reasons
        assert record.compiled_autograd_captures == 1
        torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
        for ours, reference in zip(compiled.parameters(), eager.parameters()):
            torch.testing.assert_close(ours.full_tensor(), reference.full_tensor(),
                                       rtol=0, atol=1e-5)
