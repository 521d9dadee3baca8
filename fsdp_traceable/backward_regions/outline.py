"""Outlining an AOTAutograd backward graph into one nested compile region.

Compiled autograd pastes every AOT backward it meets into its graph node by node, so
a model of L identical per-block compiled blocks gives L copies of the same block
backward, which Dynamo, AOTAutograd and Inductor then trace and compile L times.
:func:`outline` rewrites such a backward graph into a call of one
``torch.compiler.nested_compile_region`` function: the L pasted copies become L calls
of one region, which Dynamo traces once and Inductor compiles once.

The collectives stay outside the region, in the compiled-autograd graph itself, where
Inductor's reordering can overlap a block's reduce-scatter and re-gather with other
blocks' compute; so do the copies that pack a collective's input from the graph's
inputs and unpack its output into the graph's results. The region holds the rest: the
block's backward compute, the unpacking of a collective output it reads, the packing
of a collective input it produces.

[Note: backward regions need static shapes]
A block compiled with dynamic shapes is pasted as it is, each block its own copy:
- AOTAutograd compiles a backward that takes SymInts as soon as it compiles the
  forward, and saves the graph to its cache then, clearing the ``val`` meta of its
  nodes (``serialize_graph_module``); a backward loaded from that cache has none
  either. Compiled autograd reads the graph after that: without ``val`` meta
  nothing tells which values may cross a region boundary or share storage.
- Even with the meta derived again (from the placeholder values AOTAutograd keeps on
  its lazy-backward record), Dynamo would not reuse the region's trace: it matches a
  SymInt argument by object on 2.13 (compiled autograd gives every block's backward
  SymInts of its own) and by expression on 2.14 (there they carry a symbol per
  block), so each block traces its own region, used once and then inlined. Reading the sizes
  from tensor arguments instead fails where a dimension is an expression
  (``2*s0``), which Dynamo looks up among the enclosing graph's bound symbols.
``block.compile(dynamic=False)`` keeps the regions: one compile per distinct shape,
each backward outlined.

Dynamo rejects regions whose inputs or outputs share storage, so the rewrite makes an
input that is the same view as another an alias inside, copies other inputs that share
storage (saved tensors can), and copies outputs that share storage.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq
from torch.multiprocessing.reductions import StorageWeakRef

from ..fx_ops import is_collective, node_kind, op_name

__all__ = ["outline"]

log = logging.getLogger(__name__)

# Besides data movement, the collective side scales: a pre- or post-divide by the
# gradient divide factor.
_SCALING_OPS = frozenset({"div", "mul"})


def _is_copy(node: fx.Node) -> bool:
    return node_kind(node) != "other" or (
        node.op == "call_function" and op_name(node) in _SCALING_OPS)


def _inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def _collective_side(graph: fx.Graph) -> set[fx.Node]:
    """The collectives, the copies that only feed them with the graph's inputs, and
    the copies that only unpack their outputs into the graph's results. A collective
    output the compute reads enters the region as it is and is unpacked there; a
    collective input the compute produces is packed there too."""
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    side = {n for n in nodes if is_collective(n)}
    for node in reversed(nodes):  # feeders: every use is on the collective side
        if (node not in side and node.target is not operator.getitem and _is_copy(node)
                and node.users and all(u in side for u in node.users)):
            side.add(node)
    unpackers = []
    for node in nodes:  # unpackers: every input is on the collective side or an input
        if node in side or not _is_copy(node):
            continue
        inputs = _inputs(node)
        if any(i in side for i in inputs) and all(
                i in side or i.op in ("placeholder", "get_attr") for i in inputs):
            side.add(node)
            unpackers.append(node)
    for node in reversed(unpackers):  # those the compute reads go with the compute
        if any(u.op == "call_function" and u not in side for u in node.users):
            side.discard(node)
    for node in nodes:  # feeders of the compute's results go with the compute: the
        # region returns a collective's packed input, not the pieces it packs
        inputs = _inputs(node)  # (side holds no placeholder or attribute)
        if (node in side and not is_collective(node) and all(i not in side for i in inputs)
                and any(i.op == "call_function" for i in inputs)):
            side.discard(node)
    return side


def _reaches(starts: Iterable[fx.Node], edges: Callable[[fx.Node], Iterable[fx.Node]]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(starts)
    while stack:
        node = stack.pop()
        for nxt in edges(node):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


def _storage(node: fx.Node) -> StorageWeakRef | None:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return StorageWeakRef(val.untyped_storage())
    return None


def _region_function(body: fx.GraphModule) -> Callable[..., tuple[torch.Tensor, ...]]:
    def backward_region(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return body(*args)

    region = torch.compiler.nested_compile_region(backward_region)
    # FX names a call target from torch by its import path, which a nested function
    # has none of; named as this module's, the graph refers to the object itself.
    region.__module__ = __name__
    region.__qualname__ = region.__name__ = "backward_region"
    return region


def _split(graph: fx.Graph) -> tuple[list[fx.Node], set[fx.Node], set[fx.Node]]:
    """(region nodes, collective-side nodes, nodes downstream of the region)."""
    side = _collective_side(graph)
    region = [n for n in graph.nodes if n.op == "call_function" and n not in side]
    after_region = _reaches(region, lambda n: n.users)
    before_region = _reaches(region, _inputs)
    # A collective between two region nodes would have to run inside the region:
    # then the region takes the whole graph, collectives included.
    if any(n in after_region and n in before_region for n in side):
        side = set()
        region = [n for n in graph.nodes if n.op == "call_function"]
        after_region = _reaches(region, lambda n: n.users)
    return region, side, after_region


def _same_view(a: fx.Node, b: fx.Node) -> bool:
    """Whether ``a`` and ``b`` are provably the same view of one storage. Sizes,
    strides and offsets of a backward with dynamic shapes are SymInts of the AOT
    graph's shape env: compared without adding guards to it; an unprovable equality
    counts as different (the input is then copied, which is always correct)."""
    va, vb = a.meta["val"], b.meta["val"]
    return va.dtype == vb.dtype and statically_known_true(sym_eq(
        (*va.shape, *va.stride(), va.storage_offset()),
        (*vb.shape, *vb.stride(), vb.storage_offset())))


def _alias_plan(inputs: list[fx.Node]) -> dict[fx.Node, tuple[str, fx.Node | None]]:
    """How each input that shares storage with an earlier one reaches the region: as
    an alias of that one where it is the same view of it (a tensor saved with its
    detached twin), else as a copy."""
    plan: dict[fx.Node, tuple[str, fx.Node | None]] = {}
    first: dict[StorageWeakRef, list[fx.Node]] = {}
    for node in inputs:
        storage = _storage(node)
        if storage is None:
            continue
        earlier = first.setdefault(storage, [])
        twin = next((e for e in earlier if _same_view(e, node)), None)
        if twin is not None:
            plan[node] = ("alias", twin)
        elif earlier:
            plan[node] = ("copy", None)
        earlier.append(node)
    return plan


def _body(bw_module: fx.GraphModule, region: list[fx.Node], inputs: list[fx.Node],
          plan: dict, results: list[fx.Node]) -> fx.GraphModule:
    """The region's graph: ``inputs`` in, ``region``'s nodes, ``results`` out."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    region_set = set(region)
    for node in bw_module.graph.find_nodes(op="get_attr"):
        if any(u in region_set for u in node.users):
            env[node] = graph.node_copy(node)
    for node in inputs:
        if plan.get(node, ("arg",))[0] != "alias":
            env[node] = graph.placeholder(node.name)
            env[node].meta = {"val": node.meta["val"]}
    for node in inputs:
        how, twin = plan.get(node, ("arg", None))
        if how == "alias":
            env[node] = graph.call_function(torch.ops.aten.alias.default, (env[twin],))
    for node in region:
        env[node] = graph.node_copy(node, lambda n: env[n])
        if node.target is torch.ops.aten.view.default:
            # Compiled autograd pastes AOT backwards with views as reshapes (the
            # forward's view-to-reshape pass already ran); the region must too.
            env[node].target = torch.ops.aten.reshape.default
    # Outputs may share storage neither with an input nor with each other.
    taken = {_storage(n) for n in inputs} - {None}
    outputs = []
    for node in results:
        storage, value = _storage(node), env[node]
        if storage is not None and storage in taken:
            value = graph.call_function(torch.ops.aten.clone.default, (value,))
        taken.add(storage)
        outputs.append(value)
    graph.output(tuple(outputs))
    return fx.GraphModule(bw_module, graph)


def outline(bw_module: fx.GraphModule) -> fx.GraphModule | None:
    """``bw_module`` as a call of one nested compile region, or ``None`` where it has
    no compute to outline or a value the region cannot take or return.

    Args:
        bw_module: an AOTAutograd backward graph (its nodes carry ``val`` meta).

    Returns:
        A graph module with ``bw_module``'s placeholders and outputs: the collective
        side of the graph in place, the rest one region call.
    """
    # Compiled autograd reads backwards while its tracer's proxy mode is active: any
    # arithmetic on the graph's SymInt metadata would be dispatched to that tracer,
    # which does not know the AOT graph's symbols.
    with disable_proxy_modes_tracing():
        return _outline(bw_module)


def _outline(bw_module: fx.GraphModule) -> fx.GraphModule | None:
    graph = bw_module.graph
    if not any("val" in n.meta for n in graph.nodes):
        # See [Note: backward regions need static shapes].
        log.debug("backward not outlined: its graph has no val meta (AOTAutograd "
                  "cleared it when it saved the graph to its cache)")
        return None
    region, side, after_region = _split(graph)
    if not region:
        log.debug("backward not outlined: no compute outside the collectives")
        return None
    region_set = set(region)
    inputs = [n for n in graph.nodes
              if n not in region_set and n.op not in ("output", "get_attr")
              and any(u in region_set for u in n.users)]
    results = [n for n in region if any(u not in region_set for u in n.users)]
    for node in (*inputs, *results):
        if not isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt, int, float, bool)):
            # e.g. an opaque object, or a tuple crossing the boundary
            log.debug("backward not outlined: %s (%s) would cross the region boundary",
                      node.name, type(node.meta.get("val")).__name__)
            return None
    plan = _alias_plan(inputs)
    region_fn = _region_function(_body(bw_module, region, inputs, plan, results))

    new_graph = fx.Graph()
    outer: dict[fx.Node, fx.Node] = {}
    for node in graph.nodes:  # inputs, attributes, and the collective side before
        if node.op in ("placeholder", "get_attr") or (node in side and node not in after_region):
            outer[node] = new_graph.node_copy(node, lambda n: outer[n])
    call_inputs = []
    for node in inputs:
        how, _ = plan.get(node, ("arg", None))
        if how == "copy":
            call_inputs.append(new_graph.call_function(torch.ops.aten.clone.default,
                                                       (outer[node],)))
        elif how == "arg":
            call_inputs.append(outer[node])
    call = new_graph.call_function(region_fn, tuple(call_inputs))
    for index, node in enumerate(results):
        outer[node] = new_graph.call_function(operator.getitem, (call, index))
    for node in graph.nodes:  # the collective side after the region
        if node in side and node in after_region:
            outer[node] = new_graph.node_copy(node, lambda n: outer[n])
    output = graph.find_nodes(op="output")[0]
    new_graph.output(fx.map_arg(output.args[0], lambda n: outer[n]))
    return fx.GraphModule(bw_module, new_graph)
