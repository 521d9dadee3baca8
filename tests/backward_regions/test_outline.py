"""``outline``: a backward graph becomes one region call with the collectives (and the
copies around them) left outside, and computes what the graph computed.

The block backward comes from AOTAutograd itself (a ``fully_shard``-ed transformer
block compiled on its own); it runs on a real one-rank gloo group, whose collectives
move data, so the outlined graph is compared with the original bit for bit.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef

import fsdp_traceable
from fsdp_traceable.backward_regions import outline
from fsdp_traceable.fx_ops import is_collective
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer


def _block_backward() -> fx.GraphModule:
    """The AOT backward graph of one compiled block, as compiled autograd reads it."""
    backwards: list[fx.GraphModule] = []

    def keep_backward(gm: fx.GraphModule, example_inputs) -> fx.GraphModule:
        backwards.append(gm)
        return gm

    backend = aot_autograd(fw_compiler=lambda gm, _: gm, bw_compiler=keep_backward,
                           partition_fn=min_cut_rematerialization_partition)
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=8)
    model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)
    block = model.layers[0]
    # torch.compile(block): the block's collectives are in its graph (block.compile()
    # would compile its compute alone).
    compiled = torch.compile(block, backend=backend, fullgraph=True)
    compiled(torch.randn(2, 8, 16, requires_grad=True)).sum().backward()
    (backward,) = backwards
    return backward


def _region_calls(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function"
            and hasattr(n.target, "__marked_compile_region_fn__")]


def _body(gm: fx.GraphModule) -> fx.GraphModule:
    (call,) = _region_calls(gm)
    closure = call.target.__marked_compile_region_fn__.__closure__
    (body,) = [cell.cell_contents for cell in closure]
    return body


def _inputs_like(gm: fx.GraphModule) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    inputs = []
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta["val"]
        if not isinstance(val, torch.Tensor):  # torch 2.13+: the process group itself
            inputs.append(val.real_obj)
        elif val.is_floating_point():
            inputs.append(torch.randn(val.shape, generator=generator, dtype=val.dtype))
        else:
            inputs.append(torch.zeros(val.shape, dtype=val.dtype))
    return inputs


def _ops(gm: fx.GraphModule, name: str) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and name in str(n.target))


def test_block_backward_keeps_collectives_outside_the_region(one_gloo_rank: None) -> None:
    backward = _block_backward()
    outlined = outline(backward)
    assert outlined is not None
    assert len(_region_calls(outlined)) == 1
    body = _body(outlined)
    # The re-gather and the reduce-scatter (and their waits) stay in the outer graph;
    # the copy-out of the re-gathered parameters is in the region.
    assert not [n for n in body.graph.nodes if is_collective(n)]
    assert ([n.target for n in outlined.graph.nodes if is_collective(n)]
            == [n.target for n in backward.graph.nodes if is_collective(n)])
    # (On one rank the reduce-scatter is the identity; the re-gather remains.)
    assert _ops(outlined, "all_gather") == 1
    # The block's compute (every matmul) is in the region.
    assert _ops(body, "aten.mm") == _ops(backward, "aten.mm") > 0
    assert _ops(outlined, "aten.mm") == 0
    # Its inputs share no storage: the re-gathered parameters enter as the
    # all-gather's output, and of two saved views of one activation (the attention
    # output, as the attention and the output projection read it) the second enters
    # as a copy.
    (call,) = _region_calls(outlined)
    sources = [arg.args[0] if arg.target is torch.ops.aten.clone.default else arg
               for arg in call.args]
    uncopied = [StorageWeakRef(source.meta["val"].untyped_storage())
                for arg, source in zip(call.args, sources)
                if arg.target is not torch.ops.aten.clone.default
                and isinstance(source.meta.get("val"), torch.Tensor)]
    assert len(uncopied) == len(set(uncopied))
    assert [arg.target for arg in call.args].count(torch.ops.aten.clone.default) == 1


def test_outlined_block_backward_computes_the_same_bits(one_gloo_rank: None) -> None:
    backward = _block_backward()
    outlined = outline(backward)
    inputs = _inputs_like(backward)
    expected = backward(*inputs)
    got = outlined(*inputs)
    assert len(got) == len(expected)
    for ours, reference in zip(got, expected):
        if isinstance(reference, torch.Tensor):
            torch.testing.assert_close(ours, reference, rtol=0, atol=0)
        else:  # None, or an object passed through (the mesh, on torch 2.13+)
            assert ours is reference


def _graph(build) -> fx.GraphModule:
    """A hand-built graph whose placeholders carry fake values (as AOT graphs do)."""
    graph = fx.Graph()
    with FakeTensorMode():
        output = build(graph)
    graph.output(output)
    return fx.GraphModule(torch.nn.Module(), graph)


def _placeholder(graph: fx.Graph, name: str, val: torch.Tensor) -> fx.Node:
    node = graph.placeholder(name)
    node.meta["val"] = val
    return node


def _call(graph: fx.Graph, op, *args: object) -> fx.Node:
    node = graph.call_function(op, args)
    node.meta["val"] = op(*[a.meta["val"] if isinstance(a, fx.Node) else a for a in args])
    return node


def test_inputs_that_share_storage_enter_the_region_as_copies() -> None:
    # The default partitioner can save a tensor and a reshaped view of it for backward.
    def build(graph: fx.Graph):
        base = torch.empty(4, 4)
        a = _placeholder(graph, "a", base)
        b = _placeholder(graph, "b", base.view(16))
        return (_call(graph, torch.ops.aten.mm.default, a, a),
                _call(graph, torch.ops.aten.mul.Tensor, b, b))

    gm = _graph(build)
    outlined = outline(gm)
    (call,) = _region_calls(outlined)
    assert [arg.target for arg in call.args][1] is torch.ops.aten.clone.default
    a = torch.randn(4, 4)
    expected, got = gm(a, a.view(16)), outlined(a, a.view(16))
    for ours, reference in zip(got, expected):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)
    # Dynamo traces it without its aliasing error.
    compiled = torch.compile(outlined, backend="aot_eager", fullgraph=True)
    for ours, reference in zip(compiled(a, a.view(16)), expected):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_outputs_that_share_storage_leave_the_region_as_copies() -> None:
    def build(graph: fx.Graph):
        x = _placeholder(graph, "x", torch.empty(4, 4))
        y = _call(graph, torch.ops.aten.mm.default, x, x)
        return (y, _call(graph, torch.ops.aten.t.default, y))

    gm = _graph(build)
    outlined = outline(gm)
    body = _body(outlined)
    (body_output,) = body.graph.find_nodes(op="output")
    assert body_output.args[0][1].target is torch.ops.aten.clone.default
    x = torch.randn(4, 4)
    compiled = torch.compile(outlined, backend="aot_eager", fullgraph=True)
    for ours, reference in zip(compiled(x), gm(x)):
        torch.testing.assert_close(ours, reference, rtol=0, atol=0)


def test_graph_without_compute_is_left_alone() -> None:
    def build(graph: fx.Graph):
        x = _placeholder(graph, "x", torch.empty(4, 4))
        return (x, None)

    assert outline(_graph(build)) is None


def test_graph_without_fake_values_is_left_alone(caplog) -> None:
    # AOTAutograd clears every node's meta when it saves a backward to its cache.
    def build(graph: fx.Graph):
        x = _placeholder(graph, "x", torch.empty(4, 4))
        return (_call(graph, torch.ops.aten.mm.default, x, x),)

    gm = _graph(build)
    for node in gm.graph.nodes:
        node.meta = {}
    with caplog.at_level("DEBUG", logger="fsdp_traceable.backward_regions.outline"):
        assert outline(gm) is None
    assert "has no val meta" in caplog.text


def test_compute_between_collectives_goes_into_the_region_with_them(fake_world: None) -> None:
    # A collective fed by compute and feeding compute cannot stay outside: one region
    # holds the whole graph.
    group = torch.distributed.distributed_c10d._get_default_group().group_name

    def build(graph: fx.Graph):
        x = _placeholder(graph, "x", torch.empty(4, 4))
        y = _call(graph, torch.ops.aten.mm.default, x, x)
        reduced = _call(graph, torch.ops._c10d_functional.all_reduce.default, y, "sum", group)
        waited = _call(graph, torch.ops._c10d_functional.wait_tensor.default, reduced)
        return (_call(graph, torch.ops.aten.mm.default, waited, x),)

    outlined = outline(_graph(build))
    assert not [n for n in outlined.graph.nodes if is_collective(n)]
    assert len([n for n in _body(outlined).graph.nodes if is_collective(n)]) == 2


def test_results_keep_their_places_among_the_outputs() -> None:
    def build(graph: fx.Graph):
        x = _placeholder(graph, "x", torch.empty(4, 4))
        y = _placeholder(graph, "y", torch.empty(4, 4))
        return (None, _call(graph, torch.ops.aten.mm.default, x, y), y)

    gm = _graph(build)
    outlined = outline(gm)
    (output,) = outlined.graph.find_nodes(op="output")
    none, product, passed = output.args[0]
    assert none is None and passed.op == "placeholder"
    assert product.target is operator.getitem
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    got = outlined(x, y)
    assert got[0] is None and got[2] is y
    torch.testing.assert_close(got[1], x @ y, rtol=0, atol=0)


def test_an_input_that_is_the_same_view_as_another_enters_once() -> None:
    def build(graph: fx.Graph):
        base = torch.empty(4, 4)
        a = _placeholder(graph, "a", base)
        b = _placeholder(graph, "b", base.detach())
        return (_call(graph, torch.ops.aten.mm.default, a, b),)

    gm = _graph(build)
    outlined = outline(gm)
    (call,) = _region_calls(outlined)
    assert len(call.args) == 1
    a = torch.randn(4, 4)
    torch.testing.assert_close(outlined(a, a.detach())[0], a @ a, rtol=0, atol=0)
