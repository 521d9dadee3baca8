"""Patches of ``nested_compile_region``: reused calls' autograd history, and each
call's schema built once."""

from __future__ import annotations

import operator
import os
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .wrapping import wrap_once

# The package's own regions are called from its source files only (forward regions by
# fsdp/, copy regions by whole_step/): see is_package_call.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# The compiles (their CompileContext, weakly: compile ids repeat after a Dynamo reset)
# whose Dynamo trace ran a fully_shard forward: the schema memo's scope.
_package_compiles: weakref.WeakSet = weakref.WeakSet()


def _compile() -> Any | None:
    from torch._guards import CompileContext

    return CompileContext.try_get()


def mark_package_compile() -> bool:
    """Records that the compile Dynamo runs now traces the package's work (called while
    it traces a ``fully_shard`` forward); returns whether there was one to record."""
    context = _compile()
    if context is not None:
        _package_compiles.add(context)
    return context is not None


def in_package_compile() -> bool:
    """Whether the compile running now was recorded by :func:`mark_package_compile`."""
    context = _compile()
    return context is not None and context in _package_compiles


_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep


def is_package_call(tx: Any) -> bool:
    """Whether the region call Dynamo is tracing was made by the package's own code: the
    innermost traced frame outside torch (``tx`` is the region's torch wrapper, its
    ``parent`` chain the callers) is one of the package's files."""
    while tx is not None:
        code = getattr(tx, "f_code", None)
        if code is None:
            return False
        if not code.co_filename.startswith(_TORCH_DIR):
            return code.co_filename.startswith(_PACKAGE_DIR)
        tx = getattr(tx, "parent", None)
    return False


class _Linked(torch.autograd.Function):
    """``output`` unchanged (a view), with autograd history reaching ``inputs``: only
    what a traced ``backward()`` walks to find what to differentiate (the graph's
    gradients are AOTAutograd's)."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, *inputs: torch.Tensor) -> torch.Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in inputs]
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _reached_inputs(outputs: tuple, inputs: list) -> list[list[int]]:
    """Per output, the indices of ``inputs`` its autograd history reaches (it stops at
    them: a region's inputs cut it off from everything before)."""
    targets: dict[Any, list[int]] = {}
    for index, value in enumerate(inputs):
        if isinstance(value, torch.Tensor) and value.requires_grad:
            targets.setdefault(value.grad_fn if value.grad_fn is not None else id(value),
                               []).append(index)
    reached_per_output = []
    for output in outputs:
        reached: set[int] = set()
        seen: set[Any] = set()
        stack = [output.grad_fn] if isinstance(output, torch.Tensor) and output.grad_fn else []
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            key = id(fn.variable) if hasattr(fn, "variable") else fn
            if key in targets:
                reached.update(targets[key])
                continue
            stack.extend(next_fn for next_fn, _ in fn.next_functions)
        reached_per_output.append(sorted(reached))
    return reached_per_output


def link_stamped_out_regions() -> bool:
    """A region call Dynamo reuses by key gets outputs autograd connects to its inputs.

    When Dynamo reuses a traced ``nested_compile_region`` for a later call ("stamps it
    out"), it makes the call's fake outputs with ``torch.empty_strided``: tensors that
    require grad but have no autograd history. A ``backward()`` traced in the same graph
    (``trace_autograd_ops``) finds what to differentiate by walking that history, so the
    inputs of every reused call (every block's parameters but the first's) get no
    gradient. Each reused output is linked to the inputs that the same output of the
    traced call reaches (:class:`_Linked`); the graph itself is unchanged. Only calls
    of the package's own regions (made from its source, :func:`is_package_call`) are
    linked; a user's region reused in the same process stays as torch leaves it
    (``docs/repros/region_reuse_autograd_history.py``).

    Applies to: every torch with ``torch._dynamo.variables.invoke_subgraph.stamp_out_subgraph``
    (2.12 to 2.14).

    Returns:
        Whether the function is wrapped (``False`` where torch has none).
    """
    try:
        from torch._dynamo.variables import invoke_subgraph as dynamo_invoke_subgraph
    except ImportError:
        return False

    def fakes(node: fx.Node) -> list:
        return [a.meta.get("example_value") if isinstance(a, fx.Node) else a
                for a in node.args[2:]]

    def link(current: Callable[..., Any]) -> Callable[..., Any]:
        def stamp_out_subgraph(tx: Any, fingerprint: Any, cached: Any) -> Any:
            result = current(tx, fingerprint, cached)
            if not is_package_call(tx):
                return result
            calls = [n for n in tx.output.current_tracer.graph.nodes
                     if n.op == "call_function"
                     and n.target is torch.ops.higher_order.invoke_subgraph
                     and n.args[0].target == cached.body_name]
            traced, stamped = calls[0], calls[-1]
            reached = _reached_inputs(traced.meta["example_value"], fakes(traced))
            inputs = fakes(stamped)
            outputs = list(stamped.meta["example_value"])
            with tx.fake_mode, torch.enable_grad():
                for index, output in enumerate(outputs):
                    if output.requires_grad and reached[index]:
                        outputs[index] = _Linked.apply(
                            output, *(inputs[i] for i in reached[index]))
            stamped.meta["example_value"] = tuple(outputs)
            for user in stamped.users:
                if user.target is operator.getitem:
                    user.meta["example_value"] = outputs[user.args[1]]
            return result

        return stamp_out_subgraph

    return wrap_once(dynamo_invoke_subgraph, "stamp_out_subgraph", "_fsdp_traceable_links", link)


def _schema_key(subgraph: Any, identifier: str | None, operands: tuple) -> tuple | None:
    """What a region call's schema depends on besides its graph, or ``None`` where a
    symbolic size makes equal-looking calls differ (those are not memoized)."""
    parts: list[Any] = [identifier, type(subgraph), type(getattr(subgraph, "ctx", None))]
    for operand in operands:
        if isinstance(operand, torch.Tensor):
            if operand._has_symbolic_sizes_strides:
                return None
            parts.append((type(operand), tuple(operand.shape), tuple(operand.stride()),
                          operand.storage_offset(), operand.dtype, operand.device,
                          operand.requires_grad))
        elif type(operand) is int or operand is None:
            parts.append(operand)
        else:  # a SymInt, a generator, an opaque object
            return None
    return tuple(parts)


def memoize_region_schemas() -> bool:
    """Each region call's schema is built once per graph and call signature.

    Under AOTAutograd every ``nested_compile_region`` call that needs a gradient passes
    ``HigherOrderOperator``'s autograd entry, which builds the call's schema
    (``InvokeSubgraphHOP.gen_schema``) to refuse in-place input mutation, and building it
    traces the region's whole graph again: once per call, per tracing pass (three per
    call in a whole step), although every call of one region with the same argument
    layout gets the same schema. The schema is kept per region graph (weakly), its
    code (what the trace runs), and the argument layout (shapes, strides, dtypes,
    devices, ``requires_grad``); calls with symbolic sizes are not memoized. Only within
    a compile whose Dynamo trace ran a ``fully_shard`` forward
    (:func:`mark_package_compile`); a user's own compile builds every schema as torch
    builds it (``docs/repros/region_schema_retrace.py``).

    Applies to: every torch with ``InvokeSubgraphHOP.gen_schema`` (2.11 to 2.14).

    Returns:
        Whether ``gen_schema`` is memoized (``False`` where torch has none).
    """
    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:
        return False

    def memoize(current: Callable[..., Any]) -> Callable[..., Any]:
        schemas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        def gen_schema(self: Any, subgraph: Any, identifier: str | None, *operands: Any) -> Any:
            graph = getattr(subgraph, "subgraph", subgraph)  # a FunctionalizeCtxWrapper's graph
            key = _schema_key(subgraph, identifier, operands)
            if (key is None or not isinstance(graph, fx.GraphModule)
                    or not in_package_compile()):
                return current(self, subgraph, identifier, *operands)
            # Keyed by the graph's code too: a pass that edits the graph recompiles it.
            key = (graph.code, *key)
            per_graph = schemas.setdefault(graph, {})
            if key not in per_graph:
                per_graph[key] = current(self, subgraph, identifier, *operands)
            return per_graph[key]

        return gen_schema

    return wrap_once(InvokeSubgraphHOP, "gen_schema", "_fsdp_traceable_memo", memoize)
