"""What an FX node of a compiled graph does, as far as the collectives go: a
functional collective (or its wait), a data-movement copy, a view, or other work.

Shared by :mod:`fsdp_traceable.introspection.graph` (which reads the copies around each
collective out of a graph) and :mod:`fsdp_traceable.backward_regions` (which keeps
them outside a compile region). After AOTAutograd the library's copy ops are
decomposed into the aten ops listed here.
"""

from __future__ import annotations

import operator

import torch
import torch.fx

__all__ = ["COPY_OPS", "LIBRARY_NAMESPACES", "VIEW_OPS", "is_collective", "namespace_and_name",
           "node_kind", "op_name"]

VIEW_OPS = frozenset({
    "view", "_unsafe_view", "reshape", "as_strided", "slice", "t", "permute", "expand",
    "alias", "squeeze", "unsqueeze", "split", "split_with_sizes", "narrow", "select",
    "transpose", "unflatten", "flatten", "chunk", "unbind", "view_as",
})
COPY_OPS = frozenset({
    "cat", "clone", "_chunk_cat", "split_with_sizes_copy", "constant_pad_nd",
    "convert_element_type", "_to_copy", "to", "copy", "contiguous", "full", "zeros",
    "new_zeros", "empty",
})
LIBRARY_NAMESPACES = ("fsdp_traceable", "fsdp_traceable_triton")
_COLLECTIVE_NAMESPACE = "_c10d_functional"


def namespace_and_name(target: object) -> tuple[str, str] | None:
    """``("aten", "cat")`` for ``aten.cat.default`` or the packet ``aten.cat``."""
    if isinstance(target, torch._ops.OpOverload):
        return target.namespace, target._opname
    if isinstance(target, torch._ops.OpOverloadPacket):
        namespace, _, name = target._qualified_op_name.partition("::")
        return namespace, name
    return None


def op_name(node: torch.fx.Node) -> str:
    """``"cat"`` for an aten op, ``"fsdp_traceable.<op>"`` for the library's, the
    function's name otherwise."""
    target = node.target
    if target is operator.getitem:
        return "getitem"
    qualified = namespace_and_name(target)
    if qualified is not None:
        namespace, name = qualified
        return f"{namespace}.{name}" if namespace in LIBRARY_NAMESPACES else name
    return getattr(target, "__name__", str(target))


def is_collective(node: torch.fx.Node) -> bool:
    """Whether ``node`` is a functional collective or a wait on one."""
    if node.op != "call_function":
        return False
    qualified = namespace_and_name(node.target)
    return qualified is not None and qualified[0].startswith(_COLLECTIVE_NAMESPACE)


def node_kind(node: torch.fx.Node) -> str:
    """``"view"``, ``"copy"`` (data movement, the library's copy ops included) or
    ``"other"``."""
    if node.op != "call_function":
        return "other"
    name = op_name(node)
    if name in VIEW_OPS or name == "getitem":
        return "view"
    if name in COPY_OPS or name.startswith(LIBRARY_NAMESPACES):
        return "copy"
    return "other"
