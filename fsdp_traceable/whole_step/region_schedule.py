"""Two passes over a whole step whose blocks run as forward regions (see [Note: forward
regions] in ``fsdp/forward_regions.py``), run on AOTAutograd's forward-loss-backward
graph around torch's recompute pass (``_torch_patches.complete_whole_step_recompute``).

* :func:`reroute_region_inputs_to_backward` (before the recompute pass): backward
  reads a resharded group's parameters from its re-gather, not from what the forward
  region returned.
* :func:`overlap_collectives_across_regions` (after it): each collective is issued
  before the region call that precedes it and each reduce-scatter waited for after the
  region call that follows it, so a block's all-gather runs during the previous
  block's compute. Inductor keeps a collective where the graph puts it, and its
  scheduling passes do not move one across a region call.
* :func:`read_passed_through_inputs_outside_regions` (last): what a region returns of
  its own inputs is read from those inputs (see [Note: region outputs that are inputs]).

The second pass's raise also serves compiled autograd's backward, where each block's
backward is one region call (``fsdp_traceable.backward_regions``):
:class:`CompiledAutogradOverlap` runs it there as Inductor's
``post_grad_custom_post_pass`` (:func:`fsdp_traceable.inductor_options` sets it).
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch._guards import CompileContext
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from .. import fx_ops
from ..fx_ops import is_collective, op_name

__all__ = ["CompiledAutogradOverlap", "overlap_collectives_across_regions",
           "read_passed_through_inputs_outside_regions", "reroute_region_inputs_to_backward"]

log = logging.getLogger(__name__)


# What may stand between a collective's wait and the copy-out region that reads it: the
# rank-order copy of a two-step all-gather (see [Note: the post-forward piece, compiled]).
_REORDERING_OPS = frozenset({"clone", "_unsafe_view"})


def _is_region_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a block's forward region (or its backward): a region call
    that neither reads a collective's output (a copy-out region) nor feeds a collective
    (a copy-in region; see [Note: copy regions])."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.invoke_subgraph:
        return False
    reads_collective = any(_reads_wait(arg) for arg in node.all_input_nodes)
    feeds_collective = any(is_collective(user) for item in node.users for user in item.users)
    return not (reads_collective or feeds_collective)


def _reads_wait(node: fx.Node) -> bool:
    """Whether ``node`` is a collective's wait, or views or reorders one."""
    while not _is_wait(node):
        if (node.op != "call_function" or len(node.all_input_nodes) != 1
                or not (getattr(node.target, "is_view", False) or op_name(node) in _REORDERING_OPS)):
            return False
        node = node.all_input_nodes[0]
    return True


def _view_chain(output: fx.Node) -> tuple[fx.Node, list[fx.Node]] | None:
    """The placeholder ``output`` is, or a chain of view ops applied to, in a region's
    graph: ``(placeholder, views from it to output)``; ``None`` for anything else."""
    chain: list[fx.Node] = []
    node = output
    while node.op == "call_function":
        if not getattr(node.target, "is_view", False) or not node.args:
            return None
        base, *rest = node.args
        if not isinstance(base, fx.Node) or any(
                isinstance(a, fx.Node) for a in (*rest, *node.kwargs.values())):
            return None
        chain.append(node)
        node = base
    return (node, chain[::-1]) if node.op == "placeholder" else None


def _outputs_of_region_inputs(gm: fx.GraphModule, node: fx.Node
                              ) -> Iterator[tuple[fx.Node, fx.Node, list[fx.Node]]]:
    """For each output of the region call ``node`` that is one of its own inputs, or a
    chain of views of one: the ``getitem`` reading it, the input's node outside the
    region, and the views (region nodes, outermost last)."""
    region = getattr(gm, node.args[0].target)
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    outputs = next(n for n in region.graph.nodes if n.op == "output").args[0]
    operands = node.args[2:]
    for user in list(node.users):
        if user.target is not operator.getitem:
            continue
        chain = _view_chain(outputs[user.args[1]])
        if chain is None:
            continue
        placeholder, views = chain
        value = operands[placeholders.index(placeholder)]
        if isinstance(value, fx.Node):
            yield user, value, views


def reroute_region_inputs_to_backward(gm: fx.GraphModule) -> int:
    """Backward reads a forward region's recomputed inputs from the inputs themselves;
    returns how many backward reads it rerouted.

    A forward region (``invoke_subgraph``) returns the inputs its backward needs as
    outputs: a must-recompute input (a resharded group's unsharded parameter) as
    itself or as a view (``t(weight)``). The backward then reads that output, which
    keeps the forward's unsharded parameter alive to the backward and leaves torch's
    pass nothing to recompute. Each such read is rerouted to the input, through the
    same views applied outside the region (which ``recompute_views_of_recomputed``
    then tags), as a graph without regions reads them.
    """
    from torch._functorch.partitioners import must_recompute

    rerouted = 0
    for node in list(gm.graph.nodes):
        if not _is_region_call(node) or node.meta.get("autograd_backward"):
            continue
        for user, value, views in _outputs_of_region_inputs(gm, node):
            backward_users = [u for u in user.users if u.meta.get("autograd_backward")]
            if not backward_users or not must_recompute(value):
                continue
            with gm.graph.inserting_before(node):
                for view in views:
                    value = gm.graph.call_function(view.target, (value, *view.args[1:]),
                                                   dict(view.kwargs))
                    value.meta["val"] = view.meta.get("val")
            for backward_user in backward_users:
                backward_user.replace_input_with(user, value)
                rerouted += 1
    if rerouted:
        gm.graph.lint()
        gm.recompile()
    return rerouted


# [Note: region outputs that are inputs]
# Torch's partitioner of a region's forward and backward (AOTAutograd's
# ``run_joint_graph_passes_on_hops``) makes the forward return what the backward
# saves, and that includes the region's own inputs (a block's input activation, which
# LayerNorm's backward reads; an unsharded weight) or views of them. Inductor lowers
# each output of an ``invoke_subgraph`` call as a buffer of its own (``InvokeSubgraph``
# in ``torch/_inductor/ir.py``): it does not know that the output is the input's
# storage, so it frees the input's buffer after its last direct read, the region call,
# and hands that memory to the next buffer of its size, which overwrites the "saved"
# value before the backward reads it (measured on torch 2.13: a LayerNorm weight's
# gradient off by more than its size, and a checkpointed block's far worse, where
# torch's recompute pass re-runs the forward region right before its backward). In a
# whole step, forward and backward are one graph, so the forward's buffers are
# reused before the backward. Each read of such an output reads the input instead
# (through the same views, outside the region): the input's buffer then lives to its
# last read, and the output, read by nothing, is dropped.
# docs/repros/invoke_subgraph_saved_input.py shows the torch behaviour without this package.


def read_passed_through_inputs_outside_regions(gm: fx.GraphModule) -> int:
    """Every read of what a region call returns of its own inputs (an input, or a chain
    of views of one) reads that input instead; returns how many reads it rerouted.
    See [Note: region outputs that are inputs]."""
    rerouted = 0
    for node in list(gm.graph.nodes):
        if (node.op != "call_function" or node.target is not torch.ops.higher_order.invoke_subgraph
                or node.args[0].op != "get_attr"):
            continue
        for user, value, views in _outputs_of_region_inputs(gm, node):
            if not user.users:
                continue
            with gm.graph.inserting_before(node):
                for view in views:
                    value = _outer_view(gm.graph, view, value)
            rerouted += len(user.users)
            user.replace_all_uses_with(value)
            gm.graph.erase_node(user)
    if rerouted:
        gm.graph.lint()
        gm.recompile()
    return rerouted


def _outer_view(graph: fx.Graph, view: fx.Node, base: fx.Node) -> fx.Node:
    """``view`` (a view node of a region's graph, its base its only node argument)
    applied to ``base`` in ``graph``, with the value ``base``'s fake tensor gives."""
    node = graph.call_function(view.target, (base, *view.args[1:]), dict(view.kwargs))
    base_value = base.meta.get("val")
    if isinstance(base_value, torch.Tensor) and hasattr(base_value, "fake_mode"):
        with base_value.fake_mode:
            node.meta["val"] = view.target(base_value, *view.args[1:], **view.kwargs)
    else:
        node.meta["val"] = view.meta.get("val")
    return node


def _is_wait(node: fx.Node) -> bool:
    return is_collective(node) and op_name(node) == "wait_tensor"


def _reach(node: fx.Node, barrier: fx.Node, order: dict[fx.Node, int], *, upstream: bool
           ) -> list[fx.Node] | None:
    """``node`` and what it reads (``upstream``) or what reads it, transitively, on its
    side of ``barrier``, in graph order; ``None`` if that reaches ``barrier``."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current is barrier:
            return None
        beyond = (order[current] < order[barrier] if upstream
                  else order[current] > order[barrier] or current.op == "output")
        if current in found or beyond:
            continue
        found.add(current)
        stack.extend(current.all_input_nodes if upstream else current.users)
    return sorted(found, key=order.__getitem__)


def overlap_collectives_across_regions(gm: fx.GraphModule) -> int:
    """Moves collectives across the region calls next to them; returns how many moved.

    Each collective (with the copy-in that feeds it) moves before the region call
    that precedes it when it does not depend on that call; each reduce-scatter's wait
    (with what reads it) moves after the region call that follows it when that call
    does not read it. A collective moves across one region call at most, of its own
    pass (forward or backward): an all-gather raised further would keep its unsharded
    parameters alive longer. The first step of a two-step all-gather moves across two.
    """
    moved = _overlap_across_regions(gm.graph)
    if moved:
        gm.graph.lint()
        gm.recompile()
    return moved


def _overlap_across_regions(graph: fx.Graph, *, sink_reduce_waits: bool = True) -> int:
    """:func:`overlap_collectives_across_regions` on ``graph``, in place; without
    ``sink_reduce_waits``, only the raise of each collective."""
    moved = 0
    starts = [n for n in graph.nodes if is_collective(n) and not _is_wait(n)]
    for start in starts:
        moved += _raise_across_region(graph, start)
        if not sink_reduce_waits or op_name(start) != "reduce_scatter_tensor":
            continue
        nodes = list(graph.nodes)
        order = {n: i for i, n in enumerate(nodes)}
        waits = [u for u in start.users if _is_wait(u)]
        after = _region_calls_of_its_pass(nodes[order[start]:], start)
        if len(waits) != 1 or not after:
            continue
        chain = _reach(waits[0], after[0], order, upstream=False)
        if chain is not None:
            anchor = after[0]
            for node in chain:
                anchor.append(node)
                anchor = node
            moved += 1
    # The first step of a two-step all-gather (see [Note: the post-forward piece,
    # compiled]) came along, with its wait, when the loop above raised the second step,
    # whose input it is: it moves across one more region call, so that its wait is not
    # exposed. It holds 1/N of the group's parameters.
    for start in starts:
        if any(_is_wait(user) and any(is_collective(u) for u in user.users)
               for user in start.users):
            moved += _raise_across_region(graph, start)
    return moved


def _raise_across_region(graph: fx.Graph, start: fx.Node) -> int:
    """Moves ``start`` (and what it reads after the region call before it, of its own
    pass) before that region call, unless it depends on it; returns 1 if it moved."""
    nodes = list(graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    before = _region_calls_of_its_pass(nodes[: order[start]], start)
    if not before:
        return 0
    chain = _reach(start, before[-1], order, upstream=True)
    if chain is None:
        return 0
    for node in chain:
        before[-1].prepend(node)
    return 1


def _region_calls_of_its_pass(nodes: list[fx.Node], collective: fx.Node) -> list[fx.Node]:
    """The block region calls among ``nodes`` in ``collective``'s pass (forward or backward)."""
    backward = bool(collective.meta.get("autograd_backward"))
    return [n for n in nodes
            if _is_region_call(n) and bool(n.meta.get("autograd_backward")) == backward]


def _compiling_compiled_autograd_graph() -> bool:
    """Whether the graph being compiled now is compiled autograd's backward."""
    compile_id = CompileContext.current_compile_id()
    return compile_id is not None and compile_id.compiled_autograd_id is not None


class CompiledAutogradOverlap(CustomGraphPass):
    """Inductor's ``post_grad_custom_post_pass`` that prefetches each re-gather of
    compiled autograd's backward one block region ahead.

    With per-block compile, compiled autograd pastes each block's backward as one
    region call (``fsdp_traceable.backward_regions``) between that block's re-gather
    and its reduce-scatter. Inductor's overlap passes raise collectives in program
    order, behind the reduce-scatter of the block before, so each re-gather is issued
    and waited for right before its block's backward (``compile_tests/test_block_compile.py``
    pins it without this pass): the eager path's backward prefetch, lost. On compiled autograd's
    graph this pass issues each re-gather before the backward region of the block after
    it (the raise of :func:`overlap_collectives_across_regions`). Reduce-scatter waits
    stay where Inductor puts them: moved past the next region, as the whole step moves
    them, Inductor's own wait sinking then keeps every block's gradient buffer alive
    to the end of the backward. On any other graph the pass changes nothing (a whole
    step runs the full pass in its partitioner already).
    """

    def __call__(self, graph: fx.Graph) -> None:
        if not _compiling_compiled_autograd_graph():
            return
        moved = _overlap_across_regions(graph, sink_reduce_waits=False)
        if moved:
            graph.lint()
            log.debug("compiled autograd: moved %d collectives across block regions", moved)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__, fx_ops.__file__))

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"

    # Stateless: every instance is the same pass (so equal option dicts compare equal).
    def __eq__(self, other: object) -> bool:
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))
