"""Rank-side body of the compile-recipe matrix: every documented way to compile a
fully_shard-ed model, each on a fresh model, one after another in one process, through
what real runs do (see ``test_recipes.py``).

Nothing is reset between recipes: Dynamo's caches and its automatic-dynamic state carry
over from one model to the next, as in a notebook or a test suite.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import fsdp_traceable
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.testing import track_compiles
from tests.fsdp.parity_utils import full_params

RECIPES = ("whole-aot", "whole-compiled-autograd", "blocks-aot", "blocks-compiled-autograd")
BACKEND = "aot_eager"  # Dynamo and AOTAutograd without Inductor's code generation

# (phase, batch size, sequence length) per model width: a sequence length that changes
# every step, another batch size, an eval + no_grad pass between training steps; then a
# second model of another width. The second step changes both sizes at once, so each
# recipe recompiles once to make both dynamic.
SCHEDULES: dict[int, list[tuple[str, int, int]]] = {
    32: [("train", 2, 16), ("train", 3, 12), ("eval", 2, 10), ("train", 2, 14)],
    16: [("train", 2, 12), ("train", 3, 16)],
}


def _config(dim: int) -> TransformerConfig:
    # One block: the compiles per recipe are the same with more (per-block compile reuses
    # one block graph, test_block_compile.py shows it for any depth), each compile slower.
    return TransformerConfig(vocab_size=64, dim=dim, n_layers=1, n_heads=4, max_seq_len=16)


def _batch(rank: int, step: int, batch_size: int, seq_len: int
           ) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * rank + step)
    tokens = torch.randint(0, 64, (batch_size, seq_len), generator=generator)
    return tokens, torch.randint(0, 64, (batch_size, seq_len), generator=generator)


def _model(dim: int, fully_shard: Callable[..., Any]) -> Transformer:
    torch.manual_seed(dim)
    return shard_transformer(Transformer(_config(dim)), fully_shard)


def _run(rank: int, model: Transformer, schedule: list[tuple[str, int, int]],
         loss_fn: Callable[..., torch.Tensor],
         backward: Callable[[], contextlib.AbstractContextManager]) -> dict[str, Any]:
    """Trains and evaluates ``model`` over ``schedule``: losses and final parameters."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step, (phase, batch_size, seq_len) in enumerate(schedule):
        tokens, targets = _batch(rank, step, batch_size, seq_len)
        if phase == "eval":
            model.eval()
            with torch.no_grad():
                losses.append(loss_fn(tokens, targets).item())
            model.train()
            continue
        loss = loss_fn(tokens, targets)
        with backward():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_params(model)}


def _recipe(name: str, model: Transformer, forward: CompileCounterWithBackend,
            backward: CompileCounterWithBackend
            ) -> tuple[Callable[..., torch.Tensor], Callable[[], Any]]:
    """How ``name`` compiles ``model``: its loss function and its backward's context."""
    if name.startswith("whole"):
        loss_fn = torch.compile(model.loss, backend=forward, fullgraph=True)
    else:
        for block in model.layers:
            block.compile(backend=forward, fullgraph=True)
        loss_fn = model.loss
    if name.endswith("compiled-autograd"):
        compiler = torch.compile(backend=backward, fullgraph=True)
        return loss_fn, lambda: torch._dynamo.compiled_autograd._enable(compiler)
    return loss_fn, contextlib.nullcontext


@contextlib.contextmanager
def _counted(result: dict[str, Any]) -> Iterator[tuple[CompileCounterWithBackend, ...]]:
    """Counting backends (forward, compiled-autograd backward) for the block; adds to
    ``result`` the graphs each compiled, the recompile reasons, the graph breaks and the
    compiled-autograd captures."""
    forward, backward = CompileCounterWithBackend(BACKEND), CompileCounterWithBackend(BACKEND)
    with track_compiles() as record:
        yield forward, backward
    result.update(
        forward_graphs=forward.frame_count, backward_graphs=backward.frame_count,
        recompile_reasons=[f.recompile_reason for f in record.frames if f.recompile_reason],
        graph_breaks=record.graph_breaks.count,
        compiled_autograd_captures=record.compiled_autograd_captures,
    )


def recipe_matrix(rank: int, world_size: int) -> dict[str, Any]:
    """FSDP2 eager on every schedule, then each recipe in :data:`RECIPES` on fresh models.

    Returns:
        ``{"fsdp2": {dim: run}, recipe: {dim: run, <count>: ...}}`` where a run is its
        losses and final parameters (full tensors), and the counts (see
        :func:`_counted`) are the recipe's compiles over both of its models.
    """
    results: dict[str, Any] = {"fsdp2": {}}
    for dim, schedule in SCHEDULES.items():
        model = _model(dim, fsdp2_fully_shard)
        results["fsdp2"][dim] = _run(rank, model, schedule, model.loss, contextlib.nullcontext)
    for name in RECIPES:
        result: dict[str, Any] = {}
        with _counted(result) as (forward, backward):
            for dim, schedule in SCHEDULES.items():
                model = _model(dim, fsdp_traceable.fully_shard)
                loss_fn, backward_context = _recipe(name, model, forward, backward)
                result[dim] = _run(rank, model, schedule, loss_fn, backward_context)
        results[name] = result
    return results
