"""Every change this package makes to torch itself, in one place.

[Note: torch patches]
Each patch below works around one torch behaviour that has no public switch. Each
has: a docstring saying why, which torch versions it applies to (feature-detected:
where torch lacks what it patches, nothing is changed and the function returns
``False``), and one function that applies it and is safe to call again. Each has a
test in ``tests/test_torch_patches.py`` that checks the unpatched behaviour is still
a problem, so that test fails, and says the patch can go, once torch fixes it.

Where they are applied (unchanged from before they moved here):

* :func:`skip_dtensor_unflatten_frames`, :func:`drop_context_fn_warning`,
  :func:`shard_uneven_new_empty_strided`: on import of ``fsdp_traceable``
  (``fsdp/autograd_bridge.py``, whose autograd boundary, recompute region and sharded
  gradients meet them).
* :func:`drop_mesh_hash_from_pickles`: on every ``fully_shard`` call.
* :func:`rewrite_aot_backwards`: on the first parameter group built
  (``backward_regions.install``, through ``fsdp/features/block_backward.py``).
* :func:`complete_whole_step_recompute`: by :func:`fsdp_traceable.compile_step`.
* :func:`link_stamped_out_regions`, :func:`memoize_region_schemas`: when the forward
  region is made (``fsdp/forward_regions.region_of``).

No other module of the package may assign to, wrap or filter anything of torch's.
"""

from __future__ import annotations

import functools
import logging
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch._dynamo.eval_frame
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from .region_schedule import overlap_collectives_across_regions, reroute_region_inputs_to_backward

__all__ = [
    "CONTEXT_FN_WARNING",
    "CONTEXT_FN_WARNING_LOGGER",
    "REMAT_PASS_MODULE",
    "complete_whole_step_recompute",
    "drop_context_fn_warning",
    "drop_mesh_hash_from_pickles",
    "extract_bw_module_exists",
    "link_stamped_out_regions",
    "memoize_region_schemas",
    "rewrite_aot_backwards",
    "shard_uneven_new_empty_strided",
    "skip_dtensor_unflatten_frames",
]

# The patches applied so far in this process (torch's state is process-wide).
_applied: set[str] = set()


def skip_dtensor_unflatten_frames() -> bool:
    """Dynamo runs ``DTensor.__tensor_unflatten__`` eagerly when it is a frame of its own.

    A compiled backward returns the sharded gradients as plain tensors, and
    AOTAutograd's runtime wraps them back into DTensors with
    ``DTensor.__tensor_unflatten__``. When that backward runs inside a compiled
    function (``loss.backward()`` in a compiled train step, or compiled autograd's
    capture), Dynamo's frame callback is still active and compiles that frame on its
    own, which graph-breaks on the raw DTensor constructor. Running the frame eagerly
    is all the break falls back to; skipping it as a top-level frame removes the
    spurious breaks and leaves inlining it into a traced function as it was.

    Applies to: every torch with ``torch._dynamo.eval_frame.skip_code``; the break
    it avoids is present in 2.13 (the test checks the torch it runs on).

    Returns:
        Whether the frame is skipped (``False`` where torch has no ``skip_code``).
    """
    skip_code = getattr(torch._dynamo.eval_frame, "skip_code", None)
    if skip_code is None:
        return False
    if "skip_dtensor_unflatten_frames" not in _applied:
        skip_code(DTensor.__tensor_unflatten__.__code__)
        _applied.add("skip_dtensor_unflatten_frames")
    return True


def drop_mesh_hash_from_pickles() -> bool:
    """``DeviceMesh`` pickles without its process-local hash, so compile caches hit
    across restarts.

    Where a graph's inputs hold a ``DeviceMesh`` (torch 2.13 passes every DTensor
    parameter's mesh as an opaque input), Inductor's FX graph cache pickles the mesh
    into the graph's cache key. ``DeviceMesh.__getstate__`` keeps ``_hash``, the
    mesh's Python hash cached on first use: it differs in every process, so the key
    did too and a new process never found the graphs the last one compiled. A hash is
    only meaningful in the process that computed it (``DeviceMesh.__hash__``
    recomputes a missing one), so every pickle of a mesh leaves it out.

    Applies to: every torch whose ``DeviceMesh`` defines ``__getstate__`` (2.11 to
    2.14); torch's own ``__getstate__`` stays reachable as ``__wrapped__``.

    Returns:
        Whether pickles leave the hash out (``False`` where ``DeviceMesh`` has no
        ``__getstate__`` of its own).
    """
    original = DeviceMesh.__dict__.get("__getstate__")
    if original is None:
        return False
    if getattr(original, "_fsdp_traceable_drops_hash", False):
        return True

    @functools.wraps(original)
    def __getstate__(self: DeviceMesh) -> dict[str, Any]:
        state = dict(original(self))
        state.pop("_hash", None)
        return state

    __getstate__._fsdp_traceable_drops_hash = True
    DeviceMesh.__getstate__ = __getstate__
    return True


CONTEXT_FN_WARNING_LOGGER = "torch._higher_order_ops.wrap"
CONTEXT_FN_WARNING = (
    "Detected that context_fn is passed to torch.utils.checkpoint under torch.compile"
)


def _keep_unless_context_fn_warning(record: logging.LogRecord) -> bool:
    return CONTEXT_FN_WARNING not in record.getMessage()


def drop_context_fn_warning() -> bool:
    """Torch's warning about ``checkpoint(..., context_fn=...)`` under compile is dropped.

    Passing ``context_fn`` makes torch log a warning (once, when AOTAutograd traces the
    region, so no context manager around the call can hold it) asking that the region
    contain no in-place ops; safe to drop: the package's recompute-in-backward region
    (``fsdp/autograd_bridge.py``) is the functional copy-in, all-gather and copy-out
    only. The filter matches that one message on the one logger that emits it; every
    other record of that logger gets through.

    Applies to: every torch (a logging filter); torch 2.13's
    ``torch._higher_order_ops.wrap`` emits the warning (the test checks the torch it
    runs on).

    Returns:
        ``True``.
    """
    logger = logging.getLogger(CONTEXT_FN_WARNING_LOGGER)
    if _keep_unless_context_fn_warning not in logger.filters:
        logger.addFilter(_keep_unless_context_fn_warning)
    return True


def extract_bw_module_exists() -> bool:
    """Whether compiled autograd reads AOT backwards through ``extract_bw_module``."""
    module = getattr(torch._dynamo, "compiled_autograd", None)
    return module is not None and hasattr(module, "extract_bw_module")


def rewrite_aot_backwards(
    rewrite: Callable[[Any, fx.GraphModule], fx.GraphModule],
) -> bool:
    """Compiled autograd reads every AOT backward graph through ``rewrite``.

    Compiled autograd pastes every AOTAutograd backward it meets into its graph node
    by node, so L identical per-block compiled blocks give L copies of the block
    backward to trace and compile again. Torch cannot keep them as one: compiled
    autograd cannot trace a ``nested_compile_region`` (Dynamo refuses the
    ``invoke_subgraph`` it pastes), and it has no public hook. The one function it
    reads every AOT backward through,
    ``torch._dynamo.compiled_autograd.extract_bw_module(compiled_function)``, is
    wrapped so ``rewrite(compiled_function, bw_module)`` can return another graph
    (``backward_regions`` returns the block backward as one region call). The wrapper
    runs with Dynamo disabled: compiled autograd can capture while Dynamo's frame hook
    is set (torch 2.11 and 2.14 after a graph break at ``backward()``).

    Applies to: every torch with ``compiled_autograd.extract_bw_module`` (2.11 to 2.14).

    Args:
        rewrite: called with the compiled function (a class) and its backward graph;
            returns the graph compiled autograd pastes. Applying again with the same
            ``rewrite`` changes nothing.

    Returns:
        Whether compiled autograd now reads backwards through ``rewrite`` (``False``
        where torch has no ``extract_bw_module``).

    Raises:
        RuntimeError: if another ``rewrite`` is in place already.
    """
    if not extract_bw_module_exists():
        return False
    module = torch._dynamo.compiled_autograd
    current = module.extract_bw_module
    installed = getattr(current, "_fsdp_traceable_rewrite", None)
    if installed is rewrite:
        return True
    if installed is not None:
        raise RuntimeError(
            f"compiled autograd's extract_bw_module already rewrites with {installed!r}; "
            "one rewrite serves the whole process"
        )

    @torch.compiler.disable
    def extract_bw_module(compiled_function: Any) -> Any:
        bw_module = current(compiled_function)
        if not isinstance(bw_module, fx.GraphModule):
            return bw_module
        return rewrite(compiled_function, bw_module)

    extract_bw_module._fsdp_traceable_rewrite = rewrite
    module.extract_bw_module = extract_bw_module
    return True


def _shards_dim_0_only(spec: Any) -> bool:
    """Whether ``spec`` shards only tensor dim 0 (whose local stride is the global one)."""
    sharded = [p for p in spec.placements if p.is_shard()]
    return bool(sharded) and all(type(p) is Shard and p.dim == 0 for p in sharded)


def shard_uneven_new_empty_strided() -> bool:
    """DTensor's ``new_empty_strided`` keeps an unevenly sharded input's placement.

    Under compiled autograd, a parameter's first gradient is accumulated by
    ``grad.new_empty_strided(param.size(), param.stride()).copy_(grad)`` (autograd's
    gradient layout contract). Torch 2.11's DTensor lets that new tensor follow the
    gradient's sharding only if the size divides evenly over the mesh, else it is
    Replicate: the ``copy_`` all-gathers the sharded gradient and ``.grad`` becomes a
    full, replicated tensor (measured: one all-gather per unevenly sharded parameter in
    the compiled-autograd backward, ``.grad`` Replicate where FSDP2's is Shard(0)).
    Torch 2.13 lets it follow any sharding. Here it may follow a placement that shards
    tensor dim 0 only (fully_shard's default), whose local strides equal the global
    ones: the one case the uneven restriction need not cover.

    Applies to: torch whose ``new_factory_strategy`` still checks
    ``is_tensor_evenly_shardable`` (2.11; not 2.13, 2.14).

    Returns:
        Whether DTensor's strategy is patched (``False`` where torch has no restriction).
    """
    from torch.distributed.tensor._op_schema import OpSpec, OpStrategy
    from torch.distributed.tensor._ops import _tensor_ops

    factory = getattr(_tensor_ops, "new_factory_strategy", None)
    if factory is None or "is_tensor_evenly_shardable" not in factory.__code__.co_names:
        return False
    if "shard_uneven_new_empty_strided" in _applied:
        return True
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.new_empty_strided.default
    registered = propagator.op_strategy_funcs[op]

    @functools.wraps(registered)
    def strategy(op_schema: Any) -> Any:
        result = registered(op_schema)
        source = op_schema.args_schema[0]
        if not isinstance(source, OpStrategy) or tuple(source.shape) != tuple(op_schema.args_schema[1]):
            return result
        for source_spec in source.strategies:
            spec = source_spec.output_spec
            if _shards_dim_0_only(spec) and all(s.output_spec != spec for s in result.strategies):
                # Preferred over Replicate, as torch's own even-shard case.
                result.strategies.append(OpSpec(
                    output_specs=spec, input_specs=(spec,),
                    redistribute_cost=[[-0.1] * len(source.strategies)]))
        return result

    propagator.op_strategy_funcs[op] = strategy
    propagator.propagate_op_sharding.cache_clear()
    _applied.add("shard_uneven_new_empty_strided")
    return True


REMAT_PASS_MODULE = (
    "torch._functorch._activation_checkpointing.remat_using_tags_for_fwd_loss_bwd_graph_pass"
)


def _root_source(node: fx.Node) -> tuple[str, int] | None:
    """The Dynamo graph node ``node`` was traced from: its oldest ``from_node`` entry."""
    sources = node.meta.get("from_node")
    root = None
    while sources:
        root = sources[-1]
        sources = root.from_node
    return None if root is None else (root.name, root.graph_id)


def mark_backward_spans(gm: fx.GraphModule) -> int:
    """Marks every node traced by a backward call as backward; returns how many changed.

    AOTAutograd traces each node of Dynamo's graph in one go, so the nodes one
    ``torch.autograd.grad`` (or ``backward()``) node of Dynamo's graph becomes are
    contiguous in the traced graph: every node between the first and the last node
    traced from it is part of that backward.
    """
    nodes = list(gm.graph.nodes)
    spans: dict[tuple[str, int], tuple[int, int]] = {}
    for index, node in enumerate(nodes):
        if node.meta.get("autograd_backward"):
            source = _root_source(node)
            if source is not None:
                first, _ = spans.get(source, (index, index))
                spans[source] = (first, index)
    marked = 0
    for first, last in spans.values():
        for node in nodes[first : last + 1]:
            if not node.meta.get("autograd_backward"):
                node.meta["autograd_backward"] = True
                marked += 1
    return marked


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

    The pass is wrapped so both run first. Where blocks run as forward regions, the
    backward reads their recomputed parameters from the re-gather first, and after
    the pass each collective moves across the region call next to it, for overlap
    (:mod:`fsdp_traceable.region_schedule`).

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
    current = getattr(module, "remat_using_tags_for_fwd_loss_bwd_graph", None)
    if current is None:
        return False
    if getattr(current, "_fsdp_traceable_completes", False):
        return True

    @functools.wraps(current)
    def remat_using_tags_for_fwd_loss_bwd_graph(gm: fx.GraphModule) -> fx.GraphModule:
        mark_backward_spans(gm)
        reroute_region_inputs_to_backward(gm)
        recompute_views_of_recomputed(gm)
        gm = current(gm)
        overlap_collectives_across_regions(gm)
        return gm

    remat_using_tags_for_fwd_loss_bwd_graph._fsdp_traceable_completes = True
    module.remat_using_tags_for_fwd_loss_bwd_graph = remat_using_tags_for_fwd_loss_bwd_graph
    return True


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
    traced call reaches (:class:`_Linked`); the graph itself is unchanged.

    Applies to: every torch with ``torch._dynamo.variables.invoke_subgraph.stamp_out_subgraph``
    (2.12 to 2.14).

    Returns:
        Whether the function is wrapped (``False`` where torch has none).
    """
    try:
        from torch._dynamo.variables import invoke_subgraph as dynamo_invoke_subgraph
    except ImportError:
        return False
    current = getattr(dynamo_invoke_subgraph, "stamp_out_subgraph", None)
    if current is None:
        return False
    if getattr(current, "_fsdp_traceable_links", False):
        return True

    def fakes(node: fx.Node) -> list:
        return [a.meta.get("example_value") if isinstance(a, fx.Node) else a
                for a in node.args[2:]]

    @functools.wraps(current)
    def stamp_out_subgraph(tx: Any, fingerprint: Any, cached: Any) -> Any:
        result = current(tx, fingerprint, cached)
        calls = [n for n in tx.output.current_tracer.graph.nodes
                 if n.op == "call_function" and n.target is torch.ops.higher_order.invoke_subgraph
                 and n.args[0].target == cached.body_name]
        traced, stamped = calls[0], calls[-1]
        reached = _reached_inputs(traced.meta["example_value"], fakes(traced))
        inputs = fakes(stamped)
        outputs = list(stamped.meta["example_value"])
        with tx.fake_mode, torch.enable_grad():
            for index, output in enumerate(outputs):
                if output.requires_grad and reached[index]:
                    outputs[index] = _Linked.apply(output, *(inputs[i] for i in reached[index]))
        stamped.meta["example_value"] = tuple(outputs)
        for user in stamped.users:
            if user.target is operator.getitem:
                user.meta["example_value"] = outputs[user.args[1]]
        return result

    stamp_out_subgraph._fsdp_traceable_links = True
    dynamo_invoke_subgraph.stamp_out_subgraph = stamp_out_subgraph
    return True


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
    devices, ``requires_grad``); calls with symbolic sizes are not memoized.

    Applies to: every torch with ``InvokeSubgraphHOP.gen_schema`` (2.11 to 2.14).

    Returns:
        Whether ``gen_schema`` is memoized (``False`` where torch has none).
    """
    try:
        from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP
    except ImportError:
        return False
    current = getattr(InvokeSubgraphHOP, "gen_schema", None)
    if current is None:
        return False
    if getattr(current, "_fsdp_traceable_memo", False):
        return True
    schemas: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @functools.wraps(current)
    def gen_schema(self: Any, subgraph: Any, identifier: str | None, *operands: Any) -> Any:
        graph = getattr(subgraph, "subgraph", subgraph)  # a FunctionalizeCtxWrapper's graph
        key = _schema_key(subgraph, identifier, operands)
        if key is None or not isinstance(graph, fx.GraphModule):
            return current(self, subgraph, identifier, *operands)
        # Keyed by the graph's code too: a pass that edits the graph recompiles it.
        key = (graph.code, *key)
        per_graph = schemas.setdefault(graph, {})
        if key not in per_graph:
            per_graph[key] = current(self, subgraph, identifier, *operands)
        return per_graph[key]

    gen_schema._fsdp_traceable_memo = True
    InvokeSubgraphHOP.gen_schema = gen_schema
    return True
