"""Reads the collectives out of an FX graph (Dynamo's graph or AOTAutograd's forward /
backward graph) with the copies around them.

A graph is reduced to one line per copy-in, collective, wait and copy-out, in graph
order, with generated node names dropped, so the result is stable across runs and can
be pinned in a test. In a Dynamo graph the copies are the ``torch.ops.fsdp_traceable``
ops, inside the bodies of higher-order ops (``tag_activation_checkpoint``,
``autograd_function_apply``), which are shown nested. In an AOTAutograd graph those ops
have been decomposed, and the copies are the aten data-movement ops (``cat``,
``split_with_sizes``, ``clone``, dtype conversions) feeding a collective's input or
reading its output, views skipped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx

from ..fx_ops import is_collective, namespace_and_name, node_kind, op_name
from .inductor_code import collective_kind

__all__ = ["CollectiveNode", "collective_kinds", "collective_nodes", "collective_sequence"]

@dataclass(frozen=True)
class CollectiveNode:
    """One collective of a graph: its kind, op, where it is (``path`` of subgraph names,
    e.g. ``("wrap_body", "fwd_body")``), and its input and output dtype, shape and bytes."""

    kind: str
    op: str
    path: tuple[str, ...]
    dtype: torch.dtype | None
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    input_bytes: int
    output_bytes: int


def _collective_kind(node: torch.fx.Node) -> str | None:
    """The kind of a functional-collective node (``"wait"`` included), else ``None``."""
    if node.op != "call_function":
        return None
    if not is_collective(node):
        return None
    return collective_kind(namespace_and_name(node.target)[1])


def _value(node: torch.fx.Node):
    return node.meta.get("val", node.meta.get("example_value"))


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')}{list(value.shape)}"
    if isinstance(value, (list, tuple)):
        return f"{len(value)} tensors"
    return "?"


def _tensor_count(value) -> int:
    return len(value) if isinstance(value, (list, tuple)) else 1


def _copy_chain_before(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The copy ops that produce ``node``'s tensor input, through views."""
    return _copy_chain(node.all_input_nodes[:1], node.graph, lambda n: n.all_input_nodes)


def _copy_chain_after(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The copy ops that read ``node``'s output, through views."""
    return _copy_chain(list(node.users), node.graph, lambda n: list(n.users))


def _feeds_copy(node: torch.fx.Node) -> bool:
    """Whether a copy op reads ``node``'s output, directly or through views."""
    return any(node_kind(user) == "copy" or (node_kind(user) == "view" and _feeds_copy(user))
               for user in node.users)


def _copy_chain(start, graph: torch.fx.Graph, neighbours) -> list[torch.fx.Node]:
    """Copy ops reachable from ``start`` through copies and views, in graph order."""
    found, stack, seen = [], list(start), set()
    while stack:
        current = stack.pop()
        if current in seen or node_kind(current) == "other":
            continue
        seen.add(current)
        if node_kind(current) == "copy":
            found.append(current)
        stack.extend(neighbours(current))
    return sorted(found, key=_position(graph))


def _position(graph: torch.fx.Graph):
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]


def _summarize(nodes: list[torch.fx.Node]) -> str:
    counts = Counter(op_name(n) for n in nodes)
    return ", ".join(name if n == 1 else f"{name} x{n}" for name, n in counts.items())


def _subgraphs(node: torch.fx.Node) -> list[tuple[str, torch.fx.GraphModule]]:
    owner = node.graph.owning_module
    found = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr" and owner is not None:
            try:
                sub = owner.get_submodule(str(arg.target))
            except AttributeError:
                continue
            if isinstance(sub, torch.fx.GraphModule):
                found.append((str(arg.target).rstrip("0123456789_"), sub))
    return found


def collective_sequence(gm: torch.fx.GraphModule) -> list[str]:
    """The graph's copies, collectives and waits as normalized lines, in graph order.

    Lines: ``copy-in <ops> -> <tensor>``, ``<collective>(<args>) <in> -> <out>``,
    ``wait_tensor <tensor>``, ``copy-out <ops> -> <n> tensors`` (or ``-> <tensor>`` for a
    copy-out into one buffer). A higher-order op that
    contains collectives prints its name, then its subgraphs' lines indented.

    Args:
        gm: a Dynamo or AOTAutograd ``GraphModule``.

    Returns:
        The lines.
    """
    if not isinstance(gm, torch.fx.GraphModule):
        raise TypeError(f"gm must be a torch.fx.GraphModule, got {type(gm).__name__}")
    return _sequence(gm, "")


def _sequence(gm: torch.fx.GraphModule, indent: str) -> list[str]:
    lines: list[str] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        subgraphs = _subgraphs(node)
        if subgraphs:
            nested = [(name, _sequence(sub, indent + "    ")) for name, sub in subgraphs]
            if any(body for _, body in nested):
                lines.append(f"{indent}{op_name(node)}")
                for name, body in nested:
                    lines.append(f"{indent}  {name}:")
                    lines.extend(body)
            continue
        kind = _collective_kind(node)
        if kind is None:
            continue
        if kind == "wait":
            lines.append(f"{indent}wait_tensor {_describe(_value(node))}")
            copies = _copy_chain_after(node)
            if copies:
                last = [c for c in copies if not _feeds_copy(c)]
                outputs = (_describe(_value(last[0])) if len(last) == 1 else
                           f"{sum(_tensor_count(_value(c)) for c in last)} tensors")
                lines.append(f"{indent}copy-out {_summarize(copies)} -> {outputs}")
            continue
        copies = _copy_chain_before(node)
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        if copies and source is not None:
            lines.append(f"{indent}copy-in {_summarize(copies)} -> {_describe(_value(source))}")
        extra = [a for a in node.args[1:] if isinstance(a, str) and a in ("sum", "avg")]
        op = op_name(node) + (f"({extra[0]})" if extra else "")
        lines.append(
            f"{indent}{op} {_describe(_value(source)) if source is not None else '?'}"
            f" -> {_describe(_value(node))}"
        )
    return lines


def collective_kinds(gm: torch.fx.GraphModule) -> Counter:
    """How many collectives of each kind (``"wait"`` included) ``gm`` and its nested
    subgraphs hold.

    Args:
        gm: a Dynamo or AOTAutograd ``GraphModule``.

    Returns:
        A ``Counter`` keyed by collective kind.
    """
    found: Counter = Counter()
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for _, sub in _subgraphs(node):
            found += collective_kinds(sub)
        kind = _collective_kind(node)
        if kind is not None:
            found[kind] += 1
    return found


def collective_nodes(gm: torch.fx.GraphModule) -> list[CollectiveNode]:
    """Every collective (waits excluded) of ``gm`` and its nested subgraphs, with the
    dtype, shapes and bytes of its input and output from the nodes' fake values.

    Args:
        gm: a Dynamo or AOTAutograd ``GraphModule``.

    Returns:
        One :class:`CollectiveNode` per collective, in graph order.
    """
    return _collective_nodes(gm, ())


def _collective_nodes(gm: torch.fx.GraphModule, path: tuple[str, ...]) -> list[CollectiveNode]:
    found: list[CollectiveNode] = []
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        for name, sub in _subgraphs(node):
            found.extend(_collective_nodes(sub, path + (name,)))
        kind = _collective_kind(node)
        if kind is None or kind == "wait":
            continue
        source = node.all_input_nodes[0] if node.all_input_nodes else None
        value_in = _value(source) if source is not None else None
        value_out = _value(node)
        found.append(CollectiveNode(
            kind=kind,
            op=op_name(node),
            path=path,
            dtype=value_out.dtype if isinstance(value_out, torch.Tensor) else None,
            input_shape=tuple(value_in.shape) if isinstance(value_in, torch.Tensor) else (),
            output_shape=tuple(value_out.shape) if isinstance(value_out, torch.Tensor) else (),
            input_bytes=_nbytes(value_in),
            output_bytes=_nbytes(value_out),
        ))
    return found


def _nbytes(value) -> int:
    if not isinstance(value, torch.Tensor):
        return 0
    try:
        return int(value.numel()) * value.element_size()
    except (TypeError, RuntimeError):  # symbolic sizes
        return 0
