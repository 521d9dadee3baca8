"""A float8-style weight subclass with fsdp_pre/post_all_gather hooks under
``torch.compile(fullgraph=True)`` and compiled autograd: Dynamo inlines the hooks."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

import fsdp_traceable
from fsdp_traceable.testing import count_graph_breaks
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.float8_weight import (
    Float8CastWeight,
    Float8MLP,
    WrappedWeight,
    plain,
    shard_float8_mlp,
)

STEPS = 3
ALL_GATHER = "_c10d_functional.all_gather_into_tensor"


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step * 2 + rank)
    return torch.randn(4, 16, generator=generator), torch.randn(4, 5, generator=generator)


def _compiled_against_fsdp2_eager(rank: int, world_size: int) -> dict:
    torch.manual_seed(0)
    base = Float8MLP()
    theirs = shard_float8_mlp(copy.deepcopy(base), fsdp2_fully_shard)
    ours = shard_float8_mlp(copy.deepcopy(base), fsdp_traceable.fully_shard)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.1)
    opt_ours = torch.optim.SGD(ours.parameters(), lr=0.1)
    # Inductor for the forward, where the hooks' bitcasts to bytes and back are lowered;
    # the backward, plain gradients and a reduce-scatter, through AOTAutograd alone.
    loss_ours = torch.compile(ours.loss, fullgraph=True)
    backward_compiler = torch.compile(backend="aot_eager", fullgraph=True)
    losses, graph_breaks = [], 0

    def step_ours(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = loss_ours(x, y)
        with torch._dynamo.compiled_autograd._enable(backward_compiler):
            loss.backward()
        return loss

    for step in range(STEPS):
        x, y = _batch(step, rank)
        loss_theirs = theirs.loss(x, y)
        loss_theirs.backward()
        opt_theirs.step()
        opt_theirs.zero_grad()
        step_losses: list[torch.Tensor] = []
        breaks = count_graph_breaks(lambda out, a, b: out.append(step_ours(a, b)), step_losses, x, y)
        graph_breaks += breaks.count
        opt_ours.step()
        opt_ours.zero_grad()
        losses.append((loss_theirs.item(), step_losses[0].item(), breaks.reasons))
    # The loss after the last update, from the updated parameters of each side.
    next_losses = (theirs.loss(*_batch(STEPS, rank)).item(),
                   loss_ours(*_batch(STEPS, rank)).item())
    return {
        "losses": losses, "next_losses": next_losses, "graph_breaks": graph_breaks,
        "params": [(plain(a), plain(b)) for a, b in zip(theirs.parameters(), ours.parameters())],
    }


@pytest.mark.gloo
def test_compiled_training_within_1e5_of_fsdp2_eager_without_graph_breaks():
    for run in run_on_local_ranks(_compiled_against_fsdp2_eager, 2):
        assert run["graph_breaks"] == 0, [reasons for _, _, reasons in run["losses"]]
        for theirs, ours, _ in run["losses"]:
            assert abs(theirs - ours) <= 1e-5
        theirs, ours = run["next_losses"]
        assert abs(theirs - ours) <= 1e-5
        for a, b in run["params"]:
            assert (a - b).abs().max().item() <= 1e-5


def _all_gather_inputs(graph_module: torch.fx.GraphModule) -> list[tuple[torch.dtype, int]]:
    found = []
    for module in graph_module.modules():
        if isinstance(module, torch.fx.GraphModule):
            for node in module.graph.nodes:
                if ALL_GATHER in str(node.target):
                    value = node.args[0].meta["example_value"]
                    found.append((value.dtype, value.numel()))
    return found


def _forward_graph(model) -> torch.fx.GraphModule:
    """The one Dynamo graph of ``model.loss`` on the first batch (fullgraph)."""
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(graph_module)
        return graph_module.forward

    torch.compile(model.loss, backend=capture, fullgraph=True)(*_batch(0, 0))
    (graph,) = graphs
    return graph


def test_compiled_all_gather_carries_float8_weights_as_bytes(fake_world):
    model = shard_float8_mlp(Float8MLP(), fsdp_traceable.fully_shard)
    graph = _forward_graph(model)
    # Per rank: 7x16 float8 + 7 fp32 bias, 5x13 float8 + 5 fp32 bias (bytes); 3x9 + 3 fp32.
    assert _all_gather_inputs(graph) == [
        (torch.uint8, 7 * 16 + 7 * 4), (torch.uint8, 5 * 13 + 5 * 4), (torch.float32, 3 * 9 + 3),
    ]


def test_hooks_are_inlined_not_graph_ops(fake_world):
    model = shard_float8_mlp(Float8MLP(), fsdp_traceable.fully_shard)
    graph = _forward_graph(model)
    targets = {
        str(node.target) for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes
    }
    assert not any("fsdp_pre_all_gather" in t or "fsdp_post_all_gather" in t for t in targets)
    assert any("all_reduce" in t for t in targets)  # the pre hook's max-abs all-reduce


class LateHookWeight(WrappedWeight):
    """A wrapper weight that gets Float8CastWeight's hooks only after fully_shard."""


def _bf16_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
    return (self.to(torch.bfloat16),), None


def _bf16_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
    (gathered,) = all_gather_outputs
    unsharded = gathered.to(param_dtype)
    return unsharded, (gathered, unsharded)


def test_hooks_set_after_fully_shard_recompile_into_the_graph(fake_world):
    """As FSDP2 looks the hooks up at every all-gather, a compiled step does: Dynamo
    guards on the hooks it found, and hooks set later (on the class, or bound onto the
    local tensor) recompile the step with them."""
    torch.manual_seed(0)
    base = Float8MLP()
    for linear in (base.first, base.second):
        linear.weight = nn.Parameter(LateHookWeight(linear.weight.detach()._tensor))
    model = shard_float8_mlp(base, fsdp_traceable.fully_shard)
    graphs: list[torch.fx.GraphModule] = []

    def capture(graph_module: torch.fx.GraphModule, example_inputs) -> object:
        graphs.append(graph_module)
        return graph_module.forward

    step = torch.compile(model.loss, backend=capture, fullgraph=True)
    step(*_batch(0, 0))
    try:
        LateHookWeight.fsdp_pre_all_gather = Float8CastWeight.fsdp_pre_all_gather
        LateHookWeight.fsdp_post_all_gather = Float8CastWeight.fsdp_post_all_gather
        step(*_batch(0, 0))
    finally:
        del LateHookWeight.fsdp_pre_all_gather, LateHookWeight.fsdp_post_all_gather
    ordinary = model.ordinary.weight._local_tensor
    ordinary.fsdp_pre_all_gather = _bf16_pre_all_gather.__get__(ordinary)
    ordinary.fsdp_post_all_gather = _bf16_post_all_gather.__get__(ordinary)
    step(*_batch(0, 0))
    # Per rank: first 7x16 weight + 7 bias, second 5x13 + 5, ordinary 3x9 + 3.
    plain_fp32 = [(torch.float32, 7 * 16 + 7), (torch.float32, 5 * 13 + 5), (torch.float32, 30)]
    float8_bytes = [(torch.uint8, 7 * 16 + 7 * 4), (torch.uint8, 5 * 13 + 5 * 4)]
    assert [_all_gather_inputs(graph) for graph in graphs] == [
        plain_fp32,
        [*float8_bytes, (torch.float32, 30)],
        # The class hooks are gone again; the ordinary weight all-gathers in bf16 bytes.
        [*plain_fp32[:2], (torch.uint8, 3 * 9 * 2 + 3 * 4)],
    ]


def _train_two_steps(model, loss_fn, backward_context) -> list[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        loss = loss_fn(*_batch(step, 0))
        with backward_context():
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_hooks_set_after_fully_shard_compiled_within_1e5_of_fsdp2_eager(one_gloo_rank):
    torch.manual_seed(0)
    base = Float8MLP()
    for linear in (base.first, base.second):
        linear.weight = nn.Parameter(LateHookWeight(linear.weight.detach()._tensor))
    theirs = shard_float8_mlp(copy.deepcopy(base), fsdp2_fully_shard)
    ours = shard_float8_mlp(copy.deepcopy(base), fsdp_traceable.fully_shard)
    LateHookWeight.fsdp_pre_all_gather = Float8CastWeight.fsdp_pre_all_gather
    LateHookWeight.fsdp_post_all_gather = Float8CastWeight.fsdp_post_all_gather
    backward_compiler = torch.compile(backend="aot_eager", fullgraph=True)
    try:
        expected = _train_two_steps(theirs, theirs.loss, contextlib.nullcontext)
        losses = _train_two_steps(
            ours, torch.compile(ours.loss, backend="aot_eager", fullgraph=True),
            lambda: torch._dynamo.compiled_autograd._enable(backward_compiler))
    finally:
        del LateHookWeight.fsdp_pre_all_gather, LateHookWeight.fsdp_post_all_gather
    torch.testing.assert_close(losses, expected, rtol=0, atol=1e-5)
    for reference, param in zip(theirs.parameters(), ours.parameters()):
        torch.testing.assert_close(plain(param), plain(reference), rtol=0, atol=1e-5)
