"""A fully_shard-ed transformer under ``torch.compile(fullgraph=True)``: graph content,
what the forward saves for backward, and recompiles.

Single process on the fake process group: these tests check structure; the
numbers are checked on real gloo ranks in ``tests/test_fully_shard.py``.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

import fsdp_traceable
from fsdp_traceable.introspection.capture import InductorCapture
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)

# Sizes chosen so no activation has the shape of a block weight.
CONFIG = TransformerConfig(vocab_size=96, dim=48, n_layers=2, n_heads=4, hidden_dim=80,
                           max_seq_len=12)
BLOCK_WEIGHT_SHAPES = {(48, 48), (80, 48), (48, 80)}
N_GROUPS = CONFIG.n_layers + 1
ALL_GATHER = "_c10d_functional.all_gather_into_tensor.default"
REDUCE_SCATTER = "_c10d_functional.reduce_scatter_tensor.default"


def make_model(**kwargs) -> Transformer:
    torch.manual_seed(0)
    return shard_transformer(Transformer(CONFIG), fsdp_traceable.fully_shard, **kwargs)


def data() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len))
    return tokens, torch.roll(tokens, 1, dims=1)


def collective_counts(gm: torch.fx.GraphModule) -> Counter:
    return Counter(
        str(n.target) for n in gm.graph.nodes
        if n.op == "call_function" and "_c10d_functional" in str(n.target)
    )


def saved_for_backward(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    (output,) = [n for n in gm.graph.nodes if n.op == "output"]
    return list(output.args[0][1:])  # output 0 is the loss


def saved_block_weights(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    shapes = [tuple(n.meta["val"].shape) for n in saved_for_backward(gm)
              if isinstance(n.meta.get("val"), torch.Tensor)]
    return [s for s in shapes if s in BLOCK_WEIGHT_SHAPES]


def compile_and_step(model: Transformer, backend) -> CompileCounterWithBackend:
    counter = CompileCounterWithBackend(backend)
    loss = torch.compile(model.loss, backend=counter, fullgraph=True)(*data())
    loss.backward()
    return counter


def test_reshard_after_forward_recomputes_all_gathers_in_backward(fake_world: None) -> None:
    capture = InductorCapture(inductor=False)
    counter = compile_and_step(make_model(), capture.backend)
    assert counter.frame_count == 1
    assert not counters["graph_break"]
    # One all-gather per group in forward; one reduce-scatter per group in backward,
    # after re-gathering every block (the root keeps its parameters, as in FSDP2).
    assert collective_counts(capture.forward)[ALL_GATHER] == N_GROUPS
    assert collective_counts(capture.forward)[REDUCE_SCATTER] == 0
    assert collective_counts(capture.backward)[REDUCE_SCATTER] == N_GROUPS
    assert collective_counts(capture.backward)[ALL_GATHER] == N_GROUPS - 1
    assert saved_block_weights(capture.forward) == []


def test_no_reshard_after_forward_saves_unsharded_weights(fake_world: None) -> None:
    capture = InductorCapture(inductor=False)
    compile_and_step(make_model(reshard_after_forward=False), capture.backend)
    assert collective_counts(capture.forward)[ALL_GATHER] == N_GROUPS
    assert collective_counts(capture.backward)[ALL_GATHER] == 0
    assert collective_counts(capture.backward)[REDUCE_SCATTER] == N_GROUPS
    # Every block's 7 matrices (q, k, v, o, w1, w2, w3), saved in some layout.
    assert len(saved_block_weights(capture.forward)) >= 7 * CONFIG.n_layers


def _two_linear_model() -> torch.nn.Sequential:
    # Groups of two parameters: the argument count at which Dynamo, tracing an
    # autograd.Function's forward as a plain call, would drop its ctx.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def test_compiled_inference_and_frozen_groups_match_the_unsharded_model(one_gloo_rank) -> None:
    reference = _two_linear_model()
    model = _two_linear_model()
    fsdp_traceable.fully_shard(model[0])
    fsdp_traceable.fully_shard(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), reference(x), rtol=0, atol=0)
    for module in (model[0], reference[0]):
        module.requires_grad_(False)
    compiled(x).sum().backward()
    reference(x).sum().backward()
    assert model[0].weight.grad is None
    torch.testing.assert_close(model[2].weight.grad.full_tensor(), reference[2].weight.grad,
                               rtol=0, atol=0)
    assert counter.frame_count == 2  # no_grad, then grad mode with a frozen group
