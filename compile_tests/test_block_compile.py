"""Per-block compile (``block.compile(fullgraph=True)`` on every block after
``fully_shard``), backward under compiled autograd.

``block.compile()`` compiles the block's compute alone, as FSDP2's per-block compile
does: the group's all-gather, prefetch and reduce-scatter run eagerly around it (see
[Note: per-module compile]). Identical blocks share one compiled forward graph: Dynamo
reaches each block's unsharded parameters through its module (graph inputs, not
constants) and guards on nothing that differs between blocks, so compile work stays
constant in depth. Compiled autograd pastes each block's backward as one call of a
shared region (``fsdp_traceable.backward_regions``), so the backward is traced and
compiled once too, with every block's collectives (the re-gathers of
reshard-after-forward, traced from the eager forward's saved tokens, and the
reduce-scatters) outside the region.
Its numbers against FSDP2, over changing shapes and models: ``test_recipes.py``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import re
from collections import Counter

import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._inductor.compile_fx import compile_fx
from torch._inductor.utils import run_and_get_code

import fsdp_traceable
from fsdp_traceable.fsdp.module_state import entry_of
from fsdp_traceable.introspection.inductor_code import overlap
from fsdp_traceable.introspection.inlined_calls import count_inlined_calls
from fsdp_traceable.models.transformer import (
    Transformer,
    TransformerConfig,
    shard_transformer,
)
from fsdp_traceable.testing import count_collectives, track_compiles
from fsdp_traceable.tracing import regions_available
from fsdp_traceable.whole_step import region_schedule
from fsdp_traceable.whole_step.region_schedule import CompiledAutogradOverlap
from tests.fixtures import kernel_cache_only


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


# What each block adds to compiled autograd's graph of the backward, as Dynamo traces it
# (torch 2.13; 2.11 to 2.15 within a few nodes): its re-gather (the copy-in region call,
# all-gather, wait, the copy-out region call), the call of the shared backward region and
# what compiled autograd puts around it (the saved tensors, the region's outputs), its
# reduce-scatter (the copy-in region call, reduce-scatter, wait, view-out), and per
# parameter its sharded gradient (DTensor.from_local), that gradient's accumulation and
# compiled autograd's inputs. 172 here: 167 when the three copies were ops of the graph
# itself (a region call is the call, its subgraph's attribute and its output's getitem),
# which Inductor then lowered and generated again for every block; 245 when the re-gather
# also copied and re-viewed every parameter and a second autograd node per group wrapped
# the gradients.
NODES_PER_BLOCK = 172
# The calls Dynamo inlines per block while it traces that backward (the eager hooks
# compiled autograd captured, see benchmarks/block_trace_count.py for them by function),
# per torch (major, minor): 200 on 2.13 (from 4 to 16 blocks), about half of them
# torch's own (compiled autograd's unpack-hook and accumulation wrappers, its size
# unwrapping); 228 on 2.11;
# 262 on 2.15, whose Dynamo inlines four frames of torch's ConfigModule for each read
# of fsdp_traceable.config (15 a block). 311 on 2.13 when every token's unpack asked
# its group again, every gradient read its DTensor spec's properties, the extension
# check and the copy-in key ran a call or a generator step per parameter, and the
# traced-path checks took a frame more each.
INLINED_CALLS_PER_BLOCK = {(2, 11): 230, (2, 13): 205, (2, 15): 265}


def test_compile_work_per_block_is_constant(fake_world: None, inductor_cache) -> None:
    nodes, inlined, kernels = {}, {}, {}
    for n_layers in (4, 16):
        torch._dynamo.reset()
        model = _model(n_layers)
        forward = CompileCounterWithBackend("aot_eager")
        _compile_blocks(model, forward)
        # Inductor on compiled autograd's graph: its graph (what Dynamo hands it) grows
        # with depth by each block's collectives, region call and gradients; its kernels
        # must not.
        backward = CompileCounterWithBackend("inductor")
        with track_compiles() as record, count_inlined_calls() as calls:
            _, (code,) = run_and_get_code(
                lambda: _train(model, 1, torch.compile(backend=backward, fullgraph=True)))
            _train(model, 1)
        inlined[n_layers] = sum(calls.values())
        kernels[n_layers] = len(re.findall(r"^\w+ = async_compile\.", code, flags=re.M))
        # Every block runs the one forward graph (and its one AOT backward): the compute
        # only; compiled autograd compiles one backward graph.
        assert (forward.frame_count, backward.frame_count) == (1, 1), n_layers
        assert "_fsdp_compute" in [frame.name for frame in record.frames]
        assert record.graph_breaks.count == 0, record.graph_breaks.reasons
        assert record.recompiles == []
        (graph,) = forward.graphs
        assert count_collectives(graph) == Counter()
        # No eager prefetch is left in flight after the step.
        assert all(not block._fsdp_group.has_prefetch for block in model.layers)
        (backward_graph,) = backward.graphs
        assert len(_region_calls(backward_graph)) == n_layers
        # Every block's copies (re-gather copy-in and copy-out, reduce-scatter copy-in) are
        # calls of three shared regions, traced once whatever the depth: no copy op of a
        # block is left for AOTAutograd and Inductor to lower per block. (Where regions
        # take no reuse key, torch 2.11 and 2.12, the copies stay ops.)
        copies = _copy_region_calls(backward_graph)
        expected = (3 * n_layers, 3) if regions_available() else (0, 0)
        assert (len(copies), len(set(copies))) == expected, copies
        nodes[n_layers] = len(backward_graph.graph.nodes)
    # Inductor generates as many kernels for 16 blocks as for 4 (11 on 2.13): each
    # block's backward and copies are calls of the shared regions' code.
    assert kernels[4] == kernels[16] > 0, kernels
    per_block = (nodes[16] - nodes[4]) / 12
    assert per_block <= NODES_PER_BLOCK, nodes
    # The blocks' one forward compile inlines the same calls at both depths.
    version = tuple(int(part) for part in torch.__version__.split(".")[:2])
    bound = INLINED_CALLS_PER_BLOCK.get(version, max(INLINED_CALLS_PER_BLOCK.values()))
    assert (inlined[16] - inlined[4]) / 12 <= bound, inlined


def test_blocks_compiled_before_fully_shard_are_converted(fake_world: None) -> None:
    # torchtitan's order: compile, then shard. fully_shard re-wraps each block's compute
    # with the same torch.compile settings (here, the counting backend).
    torch.manual_seed(0)
    model = Transformer(_config(2))
    forward = CompileCounterWithBackend("aot_eager")
    _compile_blocks(model, forward)
    shard_transformer(model, fsdp_traceable.fully_shard)
    assert all(block._compiled_call_impl is None for block in model.layers)
    with track_compiles() as record:
        _train(model, 2)
    assert forward.frame_count == 1
    assert [frame.name for frame in record.frames] == ["_fsdp_compute"]
    assert count_collectives(forward.graphs[0]) == Counter()


def test_a_module_with_sharded_modules_below_compiles_whole(fake_world: None) -> None:
    # model.compile() (lazy: nothing compiles here), after fully_shard or before it: the
    # root keeps torch's compiled call, whose graph traces every group's collectives.
    for compile_first in (False, True):
        torch.manual_seed(0)
        model = Transformer(_config(2))
        if compile_first:
            model.compile(backend="aot_eager", fullgraph=True)
        shard_transformer(model, fsdp_traceable.fully_shard)
        if not compile_first:
            model.compile(backend="aot_eager", fullgraph=True)
        assert model._compiled_call_impl is not None
        assert entry_of(model).compiled_compute is None


def _region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each block backward region call of ``gm`` calls, in order (not the
    copy regions, which read a collective's output or feed a collective)."""
    return [str(n.args[0].target) for n in gm.graph.nodes if region_schedule._is_region_call(n)]


def _block_region_names(code: str) -> set[str]:
    """The compiled regions of Inductor's ``code`` that compute (a matmul): the block
    backward's, not the copy regions'."""
    bodies = re.split(r"^(?:def|class) ", code, flags=re.M)
    return {body.split("(", 1)[0] for body in bodies
            if body.startswith("repeated_subgraph") and "extern_kernels.mm" in body}


def _copy_region_calls(gm: torch.fx.GraphModule) -> list[str]:
    """The subgraph each copy region call of ``gm`` calls (see [Note: copy regions])."""
    return [str(n.args[0].target) for n in gm.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
            and not region_schedule._is_region_call(n)]


def test_compiled_autograd_traces_one_block_backward(
        fake_world: None, run_inductor_cache_dir) -> None:
    n_layers = 3
    model = _model(n_layers)
    _compile_blocks(model, "aot_eager")
    # Inductor with inductor_options(), whose pass overlaps the collectives below.
    backward = CompileCounterWithBackend(
        functools.partial(compile_fx, config_patches=fsdp_traceable.inductor_options()))
    with track_compiles() as record, kernel_cache_only(run_inductor_cache_dir):
        _, (code,) = run_and_get_code(
            lambda: _train(model, 2, torch.compile(backend=backward, fullgraph=True)))
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
    # Without it, Inductor issues and waits for each re-gather right before its own
    # block's backward region ([0, 0, 0]).
    # The pass of inductor_options() prefetches: every block's re-gather but the last
    # block's (the backward's first) runs during the backward region of the block after
    # it at least (Inductor's raise_comms may then issue one earlier still).
    gathers = [entry for entry in overlap(code) if entry.kind == "all_gather"]
    assert all(entry.waited for entry in gathers)
    block_regions = _block_region_names(code)
    assert 1 <= len(block_regions) <= (1 if _DYNAMO_REUSES_SUBGRAPHS else 2), block_regions
    regions_during = [sum(name in block_regions for name in entry.compute) for entry in gathers]
    assert regions_during[0] == 0 and min(regions_during[1:]) >= 1, regions_during
    # Outside compiled autograd's compile, the pass moves nothing.
    order = list(graph.graph.nodes)
    CompiledAutogradOverlap()(graph.graph)
    assert list(graph.graph.nodes) == order


def test_without_backward_regions_every_block_backward_is_pasted(fake_world: None) -> None:
    model = _model(2)
    _compile_blocks(model, "aot_eager")
    backward = CompileCounterWithBackend("aot_eager")
    with fsdp_traceable.config.patch(backward_regions=False):
        _train(model, 1, torch.compile(backend=backward, fullgraph=True))
    (graph,) = backward.graphs
    assert _region_calls(graph) == []
    assert count_collectives(graph)["reduce_scatter"] == 3
