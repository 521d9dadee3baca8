"""Torch's recompute pass for forward-loss-backward graphs, completed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from ..whole_step.region_schedule import (
    overlap_collectives_across_regions,
    read_passed_through_inputs_outside_regions,
    reroute_region_inputs_to_backward,
)
from .wrapping import wrap_once

REMAT_PASS_MODULE = (
    "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass"
)


def _root(node: fx.Node) -> Any | None:
    """The Dynamo graph node ``node`` was traced from: its oldest ``from_node`` entry."""
    sources = node.meta.get("from_node")
    root = None
    while sources:
        root = sources[-1]
        sources = root.from_node
    return root


def _traced_by_backward(node: fx.Node, root: Any | None) -> bool:
    """Whether AOTAutograd traced ``node`` from a backward call: marked so (torch 2.12+),
    or traced from Dynamo's ``torch.autograd.grad`` node (which ``backward()`` becomes)."""
    if node.meta.get("autograd_backward"):
        return True
    # A node source names its Dynamo node's target by its string (torch 2.11).
    target = getattr(root, "target", None)
    return target is torch.autograd.grad or target == repr(torch.autograd.grad)


def _pass_reads_annotation(module: Any) -> bool:
    """Whether torch's pass finds the backward by the ``remat_pass_tag`` annotation
    (torch 2.11), not by the ``autograd_backward`` mark (2.12+)."""
    is_backward = getattr(module, "_is_backward_node", None)
    return is_backward is not None and "remat_pass_tag" in is_backward.__code__.co_consts


def _mark_backward(node: fx.Node) -> bool:
    """Marks ``node`` backward; returns whether it was not marked already."""
    if node.meta.get("autograd_backward"):
        return False
    node.meta["autograd_backward"] = True
    return True


def mark_backward_spans(gm: fx.GraphModule, *, annotate: bool = False) -> int:
    """Marks every node traced by a backward call as backward; returns how many changed.

    AOTAutograd traces each node of Dynamo's graph in one go, so the nodes one
    ``torch.autograd.grad`` (or ``backward()``) node of Dynamo's graph becomes are
    contiguous in the traced graph: every node between the first and the last node
    traced from it is part of that backward.

    Args:
        gm: the forward-loss-backward graph.
        annotate: also annotate the backward as torch 2.11's pass looks for it
            (``fx.traceback.annotate({"remat_pass_tag": "is_backward"})``'s meta).
    """
    nodes = list(gm.graph.nodes)
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for index, node in enumerate(nodes):
        root = _root(node)
        if root is not None and _traced_by_backward(node, root):
            source = (root.name, root.graph_id)
            first, _ = spans.get(source, (index, index))
            spans[source] = (first, index)
    marked = 0
    for first, last in spans.values():
        for node in nodes[first : last + 1]:
            if annotate:
                node.meta.setdefault("custom", {})["remat_pass_tag"] = "is_backward"
            marked += _mark_backward(node)
    return marked


def mark_recomputed_as_backward(gm: fx.GraphModule) -> int:
    """Marks the nodes torch's pass re-ran in backward as backward; returns how many.

    Torch 2.11 and 2.12's pass copies each recomputed node, named
    ``<original>_recomputed``, with its forward original's meta, so the copies (placed
    right before the backward nodes that read them) carry no ``autograd_backward``
    mark; torch 2.13 marks them itself.
    """
    return sum(_mark_backward(node) for node in gm.graph.nodes if node.name.endswith("_recomputed"))


def recompute_views_of_recomputed(gm: fx.GraphModule) -> int:
    """Tags every forward view of a must-recompute value must-recompute too; returns how
    many nodes it tagged."""
    from torch._functorch.partitioners import must_recompute

    tagged = 0
    for node in gm.graph.nodes:
        if (node.op != "call_function" or node.meta.get("autograd_backward")
                or must_recompute(node) or not getattr(node.target, "is_view", False)):
            continue
        base = node.args[0] if node.args else None
        if isinstance(base, fx.Node) and must_recompute(base):
            node.meta["recompute"] = base.meta["recompute"]
            if "ac_graph_id" in base.meta:
                node.meta["ac_graph_id"] = base.meta["ac_graph_id"]
            tagged += 1
    return tagged


PACKAGE_OPS = "fsdp_traceable."


def _root_target(node: fx.Node) -> str:
    root = _root(node)
    return str(getattr(root, "target", "")) if root is not None else ""


def holds_package_ops(gm: fx.GraphModule) -> bool:
    """Whether ``gm`` (or a region's graph in it) was traced from the package's work: an
    op of the ``torch.ops.fsdp_traceable`` namespace, in the graph or in Dynamo's graph
    it was traced from (the copy ops decompose, so AOTAutograd's graph holds them only
    as the ``from_node`` sources of their nodes)."""
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            namespace = getattr(node.target, "namespace", None)
            if namespace == PACKAGE_OPS[:-1] or _root_target(node).startswith(PACKAGE_OPS):
                return True
    return False


def complete_whole_step_recompute() -> bool:
    """Torch's recompute pass for forward-loss-backward graphs re-gathers every
    resharded group in backward and keeps none of its unsharded parameters.

    A forward-loss-backward graph (``loss.backward()`` traced with
    ``torch._dynamo.config.trace_autograd_ops``) re-runs recompute-tagged ops (the
    all-gather of a group that reshards after forward) right before the backward nodes
    that use them. Two gaps in torch's pass (measured on 2.12 to 2.14):

    * It finds the backward by the ``autograd_backward`` mark on its nodes, and the
      nodes of a Dynamo-traced ``autograd.Function``'s backward lose that mark
      (``AutogradFunctionApply`` runs its backward graph through an ``fx.Interpreter``,
      which replaces the current node meta with the subgraph node's). Every group's
      reduce-scatter then splits the backward, and the pass refuses the graph:
      "Detected 3 disjoint backward regions that require recomputation, but remat only
      supports one such region". Every node one backward call was traced into is marked
      backward (:func:`mark_backward_spans`).
    * It re-runs only tagged nodes, so a backward reading a forward view of the
      recomputed value (``t(weight)`` of a linear layer) reads the forward's, and every
      unsharded weight stays alive from forward to backward. Views of a recomputed value
      are recomputed too (:func:`recompute_views_of_recomputed`), as the min-cut
      partitioner of a joint graph recomputes them.

    Torch 2.11's pass finds the backward by an annotation instead
    (``fx.traceback.annotate({"remat_pass_tag": "is_backward"})``), which nothing sets
    for a traced ``loss.backward()``: it re-gathered nothing, and every unsharded
    parameter lived from forward to backward. There the backward is annotated too.
    On 2.11 and 2.12 the nodes the pass re-runs carry their forward originals' meta;
    they are marked backward after it (:func:`mark_recomputed_as_backward`).

    The pass is wrapped so both run first, on graphs that hold the package's ops only
    (:func:`holds_package_ops`): any other graph, a user's own, gets torch's pass
    unchanged. Applied by :func:`fsdp_traceable.compile_step` and whenever Dynamo
    traces a ``fully_shard`` module's forward with ``trace_autograd_ops`` on (see
    [Note: the whole step's passes in every whole step] in
    ``fsdp/traced_step_passes.py``). Where blocks run as forward regions, the backward
    reads their recomputed parameters from the re-gather first, and after
    the pass each collective moves across the region call next to it, for overlap,
    and what a region returns of its own inputs is read from those inputs, which
    Inductor would otherwise overwrite before the backward reads them
    (:mod:`fsdp_traceable.whole_step.region_schedule`).

    Applies to: every torch whose AOTAutograd runs
    ``remat_using_tags_for_fwd_loss_bwd_graph`` on inference graphs, looked up in its
    module at each call (2.11 to 2.14).

    Returns:
        Whether the pass is wrapped (``False`` where torch has no such pass).
    """
    import importlib

    try:
        module = importlib.import_module(REMAT_PASS_MODULE)
    except ImportError:
        return False
    annotate = _pass_reads_annotation(module)

    def complete(current: Callable[..., Any]) -> Callable[..., Any]:
        def remat_using_tags_for_fwd_loss_bwd_graph(gm: fx.GraphModule) -> fx.GraphModule:
            if not holds_package_ops(gm):
                return current(gm)
            mark_backward_spans(gm, annotate=annotate)
            reroute_region_inputs_to_backward(gm)
            recompute_views_of_recomputed(gm)
            gm = current(gm)
            mark_recomputed_as_backward(gm)
            overlap_collectives_across_regions(gm)
            read_passed_through_inputs_outside_regions(gm)
            return gm

        return remat_using_tags_for_fwd_loss_bwd_graph

    return wrap_once(module, "remat_using_tags_for_fwd_loss_bwd_graph",
                     "_fsdp_traceable_completes", complete)
