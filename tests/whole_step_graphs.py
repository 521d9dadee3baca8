"""What a whole step's graph (forward, loss and backward traced as one, ``compile_step``)
keeps from its forward for its backward, shared by ``tests/`` and ``compile_tests/``."""

from __future__ import annotations

import torch


def backward_nodes(gm: torch.fx.GraphModule) -> set[torch.fx.Node]:
    """The nodes from the first backward node on (the forward comes first in a whole
    step; torch 2.12's recompute pass leaves its copies unmarked)."""
    nodes = list(gm.graph.nodes)
    first = next(i for i, n in enumerate(nodes) if n.meta.get("autograd_backward"))
    return set(nodes[first:])


def kept_for_backward(gm: torch.fx.GraphModule) -> list[tuple[int, ...]]:
    """Shapes of the forward's values that backward nodes read (inputs and their views
    aside)."""
    backward = backward_nodes(gm)
    kept = {inp for node in backward for inp in node.all_input_nodes
            if inp not in backward and not _of_input(inp)}
    return [tuple(n.meta["val"].shape) for n in kept
            if isinstance(n.meta.get("val"), torch.Tensor)]


def _of_input(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a graph input (a sharded parameter) or a view of one."""
    while getattr(node.target, "is_view", False):
        node = node.args[0]
    return node.op == "placeholder"
