"""The patches of torch (``fsdp_traceable/_torch_patches/``).

Per patch: what it changes, and a check that torch without it still has the problem,
named ``test_torch_still_...``. When one of those fails, torch fixed the problem on
the version under test: the patch can go there (see [Note: torch patches]).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import pickle
from collections.abc import Iterator

import pytest
import torch
import torch.fx as fx
from torch._dynamo.utils import counters
from torch._inductor.codecache import FxGraphCachePickler
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.inspect.capture import InductorCapture
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.testing import count_collectives
from fsdp_traceable.testing.fake_world import fake_process_group
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

compiled_autograd = torch._dynamo.compiled_autograd


# -- Dynamo skips DTensor.__tensor_unflatten__ as a frame of its own ----------------

@pytest.fixture
def dtensor_parts() -> Iterator[tuple[dict[str, torch.Tensor], object, torch.Size, tuple]]:
    """The arguments AOTAutograd's runtime passes ``DTensor.__tensor_unflatten__``."""
    with fake_process_group(1):
        mesh = init_device_mesh("cpu", (1,))
        dtensor = DTensor.from_local(torch.randn(4, 4), mesh, [Shard(0)], run_check=False)
        names, spec = dtensor.__tensor_flatten__()
        yield {name: getattr(dtensor, name) for name in names}, spec, dtensor.size(), dtensor.stride()


def test_torch_still_cannot_trace_dtensor_unflatten(dtensor_parts) -> None:
    inner, spec, size, stride = dtensor_parts

    def unflatten(inner: dict[str, torch.Tensor]) -> DTensor:
        return DTensor.__tensor_unflatten__(inner, spec, size, stride)

    with pytest.raises(torch._dynamo.exc.Unsupported):
        torch.compile(unflatten, backend="eager", fullgraph=True)(inner)


def test_dtensor_unflatten_frame_runs_eagerly_without_a_graph_break(dtensor_parts) -> None:
    assert _torch_patches.skip_dtensor_unflatten_frames()
    assert _torch_patches.skip_dtensor_unflatten_frames()  # again: no change
    inner, spec, size, stride = dtensor_parts
    counters.clear()
    out = torch.compile(DTensor.__tensor_unflatten__, backend="eager")(inner, spec, size, stride)
    assert isinstance(out, DTensor)
    assert not counters["graph_break"]


# -- DeviceMesh pickles without its process-local hash --------------------------------

needs_mesh_getstate = pytest.mark.skipif(
    "__getstate__" not in DeviceMesh.__dict__,
    reason="this torch's DeviceMesh has no __getstate__")


def _fx_cache_key_bytes(obj: object) -> bytes:
    """What Inductor's FX graph cache hashes into a key for ``obj``."""
    return FxGraphCachePickler(torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())).dumps(obj)


@needs_mesh_getstate
def test_torch_still_pickles_the_mesh_hash() -> None:
    assert _torch_patches.drop_mesh_hash_from_pickles()
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        hash(mesh)
        # torch's own state keeps the hash, so its pickles differ between processes.
        assert "_hash" in DeviceMesh.__getstate__.__wrapped__(mesh)


@needs_mesh_getstate
def test_pickled_mesh_has_no_hash_and_unpickles_equal() -> None:
    assert _torch_patches.drop_mesh_hash_from_pickles()
    patched = DeviceMesh.__getstate__
    assert _torch_patches.drop_mesh_hash_from_pickles()  # again: not wrapped twice
    assert DeviceMesh.__getstate__ is patched
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        mesh_hash = hash(mesh)
        assert "_hash" not in mesh.__getstate__()
        restored = pickle.loads(pickle.dumps(mesh))
        assert restored == mesh
        assert hash(restored) == mesh_hash


@needs_mesh_getstate
def test_fx_graph_cache_key_does_not_depend_on_the_hash_a_process_drew() -> None:
    with fake_process_group(2, reset_dynamo=False):
        mesh = init_device_mesh("cpu", (2,))
        hash(mesh)
        _torch_patches.drop_mesh_hash_from_pickles()
        keys = set()
        for drawn_hash in (12345, -67890):
            mesh._hash = drawn_hash  # what hash(mesh) cached in two different processes
            keys.add(_fx_cache_key_bytes([mesh]))
        assert len(keys) == 1


# -- torch's context_fn warning, not logged for the package's own region ---------------

class _Keep(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_torch_still_logs_the_context_fn_warning_once_per_process() -> None:
    # Logged once per process through a cached warning_once (so a logging filter that
    # dropped the package's record would use up a user's warning too), so read from the
    # source: the message, the logger, the function that logs it and its caller.
    module = torch._higher_order_ops.wrap
    assert module.__name__ == _torch_patches.CONTEXT_FN_WARNING_LOGGER
    assert module.log.name == _torch_patches.CONTEXT_FN_WARNING_LOGGER
    assert _torch_patches.CONTEXT_FN_WARNING in inspect.getsource(module.tag_activation_checkpoint_impl)
    assert "warning_once" in module.tag_activation_checkpoint_impl.__code__.co_names
    assert "gmod" in inspect.signature(module.tag_activation_checkpoint_impl).parameters
    torch_warning_once = module.warning_once
    if getattr(torch_warning_once, "_fsdp_traceable_skips_quiet", False):
        torch_warning_once = torch_warning_once.__wrapped__
    assert hasattr(torch_warning_once, "cache_info")  # functools.cache


def _log_from_a_checkpoint_trace(gmod: fx.GraphModule, message: str) -> None:
    """Logs ``message`` as ``tag_activation_checkpoint_impl(gmod, ...)`` does."""
    torch._higher_order_ops.wrap.warning_once(torch._higher_order_ops.wrap.log, message)


def test_context_fn_warning_skipped_for_marked_regions_only() -> None:
    module = torch._higher_order_ops.wrap
    assert _torch_patches.drop_context_fn_warning()
    patched = module.warning_once
    assert _torch_patches.drop_context_fn_warning()  # again: no change
    assert module.warning_once is patched

    @_torch_patches.quiet_context_fn
    def ours() -> None: ...

    def users() -> None: ...

    quiet, loud = (fx.GraphModule(torch.nn.Module(), fx.Graph()) for _ in range(2))
    quiet.meta["_checkpoint_context_fn"] = ours
    loud.meta["_checkpoint_context_fn"] = users
    # Messages of this test's own (torch's is logged once per process: not used up here).
    handler = _Keep()
    module.log.addHandler(handler)
    try:
        _log_from_a_checkpoint_trace(quiet, "fsdp_traceable test: a marked region")
        _log_from_a_checkpoint_trace(loud, "fsdp_traceable test: a user's region")
        module.warning_once(module.log, "fsdp_traceable test: no region")
        _log_from_a_checkpoint_trace(quiet, "fsdp_traceable test: a marked region")
        _log_from_a_checkpoint_trace(loud, "fsdp_traceable test: a user's region")  # once
    finally:
        module.log.removeHandler(handler)
    assert handler.messages == ["fsdp_traceable test: a user's region",
                                "fsdp_traceable test: no region"]
    # A user's region compiled after the package's: tests/test_import_side_effects.py.


# -- compiled autograd reads AOT backwards through a rewrite ---------------------------

needs_extract_bw_module = pytest.mark.skipif(
    not _torch_patches.extract_bw_module_exists(),
    reason="this torch's compiled autograd has no extract_bw_module")


@needs_extract_bw_module
@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                    reason="this torch has no nested_compile_region")
def test_torch_still_cannot_compile_a_region_backward_under_compiled_autograd() -> None:
    """A region called twice: compiled autograd pastes its backward as
    ``invoke_subgraph`` calls, which Dynamo refuses to trace."""

    @torch.compiler.nested_compile_region
    def region(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.sin(x @ w)

    def twice(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return region(region(x, w), w).sum()

    torch._dynamo.reset()
    try:
        x = torch.randn(4, 4, requires_grad=True)
        w = torch.randn(4, 4, requires_grad=True)
        loss = torch.compile(twice, backend="aot_eager", fullgraph=True)(x, w)
        with pytest.raises(torch._dynamo.exc.Unsupported, match="invoke_subgraph"):
            with compiled_autograd._enable(torch.compile(backend="eager", fullgraph=True)):
                loss.backward()
    finally:
        torch._dynamo.reset()


def _graph() -> fx.GraphModule:
    graph = fx.Graph()
    graph.output((graph.placeholder("x"),))
    return fx.GraphModule(torch.nn.Module(), graph)


@needs_extract_bw_module
def test_backwards_read_through_the_rewrite_wrapped_once(monkeypatch) -> None:
    original, rewritten = _graph(), _graph()
    monkeypatch.setattr(compiled_autograd, "extract_bw_module",
                        lambda compiled_function: compiled_function)
    seen = []

    def rewrite(compiled_function: object, bw_module: fx.GraphModule) -> fx.GraphModule:
        seen.append((compiled_function, bw_module))
        return rewritten

    assert _torch_patches.rewrite_aot_backwards(rewrite)
    wrapper = compiled_autograd.extract_bw_module
    assert _torch_patches.rewrite_aot_backwards(rewrite)  # again: not wrapped twice
    assert compiled_autograd.extract_bw_module is wrapper
    assert wrapper(original) is rewritten
    assert seen == [(original, original)]
    not_a_graph = object()
    assert wrapper(not_a_graph) is not_a_graph  # only graphs reach the rewrite
    with pytest.raises(RuntimeError, match="already rewrites"):
        _torch_patches.rewrite_aot_backwards(lambda cls, gm: gm)


# -- DTensor's new_empty_strided keeps an uneven Shard(0) ---------------------------

def _dim0_piece(mesh: DeviceMesh, rows: int, global_rows: int, cols: int) -> DTensor:
    """Rank 0's ``[rows, cols]`` piece of a ``[global_rows, cols]`` tensor sharded on dim 0."""
    return DTensor.from_local(torch.randn(rows, cols), mesh, [Shard(0)], run_check=False,
                              shape=torch.Size((global_rows, cols)), stride=(cols, 1))


@pytest.fixture
def uneven_mesh() -> Iterator[DeviceMesh]:
    """A 1-D mesh of 4 fake ranks: 29 rows shard as 8, 8, 8, 5."""
    with fake_process_group(4):
        yield init_device_mesh("cpu", (4,))


def _new_empty_strided(dtensor: DTensor) -> DTensor:
    return dtensor.new_empty_strided(dtensor.size(), dtensor.stride())


def test_torch_still_replicates_an_uneven_new_empty_strided(uneven_mesh) -> None:
    if not _torch_patches.shard_uneven_new_empty_strided():
        pytest.skip("this torch keeps an uneven shard's placement on its own (no patch "
                    "applied; the next test shows the placement)")
    # Another shape than the next test's (DTensor caches the result per op and shapes).
    piece = _dim0_piece(uneven_mesh, 8, 30, 7)
    propagator = DTensor._op_dispatcher.sharding_propagator
    op = torch.ops.aten.new_empty_strided.default
    patched = propagator.op_strategy_funcs[op]
    propagator.op_strategy_funcs[op] = patched.__wrapped__
    propagator.propagate_op_sharding.cache_clear()
    try:
        assert _new_empty_strided(piece).placements == (Replicate(),)
    finally:
        propagator.op_strategy_funcs[op] = patched
        propagator.propagate_op_sharding.cache_clear()


def test_compiled_autograd_keeps_uneven_gradients_sharded(uneven_mesh) -> None:
    # new_empty_strided itself, then a compiled-autograd backward (what calls it): the
    # gradients stay Shard(0) with the parameters' local shapes, and the backward
    # all-gathers only the resharded block's bucket, no parameter on its own.
    empty = _new_empty_strided(_dim0_piece(uneven_mesh, 8, 29, 29))
    assert empty.placements == (Shard(0),) and empty.to_local().shape == (8, 29)

    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=40, dim=29, n_layers=1, n_heads=1, hidden_dim=37,
                               max_seq_len=8)
    model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)
    tokens = torch.randint(0, 40, (2, 8))
    loss = torch.compile(model.loss, backend="aot_eager", fullgraph=True)(tokens, tokens)
    capture = InductorCapture(inductor=False)
    with compiled_autograd._enable(torch.compile(backend=capture.backend, fullgraph=True)):
        loss.backward()
    # Compiled autograd's graph runs without grad: AOTAutograd's inference graph.
    assert count_collectives(capture.graph_modules["aot_inference"])["all_gather"] == 1
    for name, param in model.named_parameters():
        assert param.grad.placements == (Shard(0),), name
        assert param.grad.to_local().shape == param.to_local().shape, name


# -- Dynamo traces backward() into DTensor parameters (torch 2.11) --------------------

needs_subclass_patch = pytest.mark.skipif(
    not _torch_patches.subclass_patch_needed(),
    reason="this torch's Dynamo traces backward() into tensor subclasses itself, or not at all")


def _dtensor_step_grad(monkeypatch, patched: bool) -> torch.Tensor:
    """``(w * x).sum().backward()`` compiled over a DTensor parameter ``w``: its gradient."""
    from torch._dynamo.variables import torch as torch_variables

    assert _torch_patches.trace_backward_into_subclasses()
    if not patched:
        wrapper = torch_variables._collect_tensors_with_sources
        monkeypatch.setattr(torch_variables, "_collect_tensors_with_sources", wrapper.__wrapped__)
    with fake_process_group(1), torch._dynamo.config.patch(trace_autograd_ops=True):
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(DTensor.from_local(torch.arange(4.0), mesh, [Shard(0)]))
        x = DTensor.from_local(torch.full((4,), 3.0), mesh, [Shard(0)])

        def step(x: DTensor) -> None:
            (weight * x).sum().backward()

        torch._dynamo.reset()
        torch.compile(step, backend="aot_eager", fullgraph=True)(x)
        return weight.grad


@needs_subclass_patch
def test_torch_still_asserts_on_dtensor_leaves_in_backward(monkeypatch) -> None:
    with pytest.raises(Exception) as raised:  # Dynamo's bare assert on the DTensor
        _dtensor_step_grad(monkeypatch, patched=False)
    error = raised.value
    assert isinstance(error, AssertionError) or isinstance(error.__cause__, AssertionError)


@needs_subclass_patch
def test_backward_traced_into_dtensor_parameters(monkeypatch) -> None:
    grad = _dtensor_step_grad(monkeypatch, patched=True)
    assert isinstance(grad, DTensor) and torch.equal(grad.to_local(), torch.full((4,), 3.0))


# -- the whole step's recompute pass sees one backward and recomputes views -------------


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward()")
def test_torch_still_refuses_a_whole_step_with_two_resharded_groups() -> None:
    # fsdp_traceable.compile_step without the wrapped pass: each block's reduce-scatter,
    # in its autograd.Function's backward, splits the traced backward (2.12+); torch
    # 2.11's pass finds no backward at all (it looks for an annotation nothing sets
    # here) and re-gathers nothing, so every block's unsharded parameters live from
    # forward to backward.
    from torch._dynamo.backends.common import aot_autograd

    from fsdp_traceable._torch_patches.whole_step_recompute import _pass_reads_annotation

    _torch_patches.trace_backward_into_subclasses()
    _torch_patches.complete_whole_step_recompute()
    module = importlib.import_module(_torch_patches.REMAT_PASS_MODULE)
    patched = module.remat_using_tags_for_fwd_loss_bwd_graph
    config = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: object) -> fx.GraphModule:
        graphs.append(gm)
        return gm

    with fake_process_group(2):
        torch.manual_seed(0)
        model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = model.loss(tokens, tokens)
            loss.backward()
            return loss.detach()

        module.remat_using_tags_for_fwd_loss_bwd_graph = patched.__wrapped__
        refused = (contextlib.nullcontext() if _pass_reads_annotation(module)
                   else pytest.raises(Exception, match="disjoint backward regions"))
        try:
            # Without forward regions: each block's autograd.Function in the graph.
            with (torch._dynamo.config.patch(trace_autograd_ops=True),
                  torch._functorch.config.patch(enable_autograd_cache=False),
                  fsdp_traceable.config.patch(forward_regions=False), refused):
                backend = aot_autograd(fw_compiler=keep, inference_compiler=keep)
                torch.compile(step, backend=backend, fullgraph=True)(torch.zeros(2, 8, dtype=torch.long))
        finally:
            module.remat_using_tags_for_fwd_loss_bwd_graph = patched
    if _pass_reads_annotation(module):
        # One all-gather per group (the root and 2 blocks), none again in backward.
        assert count_collectives(graphs[-1])["all_gather"] == 3


# -- A region call Dynamo reuses by key has outputs without autograd history ---------

def _unlinked_block_grads(monkeypatch) -> list[bool]:
    """Per block of a 2-block ``fully_shard`` transformer whose whole step runs its blocks
    as forward regions (the second call reused by key), without the link patch: whether
    its parameters got gradients."""
    from torch._dynamo.variables import invoke_subgraph as dynamo_invoke_subgraph

    with fake_process_group(2), fsdp_traceable.config.patch(forward_regions=True):
        torch.manual_seed(0)
        model = shard_transformer(Transformer(TransformerConfig(n_layers=2, dim=16)),
                                  fsdp_traceable.fully_shard)
        # Unpatched after fully_shard, which applies the patch.
        assert _torch_patches.link_stamped_out_regions()
        patched = dynamo_invoke_subgraph.stamp_out_subgraph
        monkeypatch.setattr(dynamo_invoke_subgraph, "stamp_out_subgraph", patched.__wrapped__)

        def step(tokens: torch.Tensor) -> torch.Tensor:
            loss = model.loss(tokens, tokens)
            loss.backward()
            return loss.detach()

        torch._dynamo.reset()
        fsdp_traceable.compile_step(step, backend="aot_eager")(torch.zeros(2, 8, dtype=torch.long))
        return [all(p.grad is not None for p in block.parameters()) for block in model.layers]


needs_keyed_regions = pytest.mark.skipif(
    not fsdp_traceable.tracing.regions_available() or not dynamo_traces_backward_into_dtensors(),
    reason="this torch's nested_compile_region takes no reuse key")


@needs_keyed_regions
def test_torch_still_leaves_a_reused_region_call_without_autograd_history(monkeypatch) -> None:
    # The reused call's block gets no gradient (reached from the loss through nothing).
    # Patched, every block gets its gradient: compile_tests/test_whole_step.py (the
    # forward-regions case), as FSDP2 eager's bit for bit with Llama's layers.
    assert _unlinked_block_grads(monkeypatch)[1] is False


# -- Every region call that needs a gradient traces the region again for its schema ---

def _region_schema_traces() -> tuple[int, list[str]]:
    """Compiles (AOTAutograd, eager backend) a function calling one region three times
    with one argument layout, then backward; returns how often the region's graph was
    traced again to build a call's schema, and the schemas built."""
    from torch._higher_order_ops import utils as hop_utils
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    traces, schemas = [], []
    materialize = hop_utils.materialize_as_graph
    gen_schema = InvokeSubgraphHOP.gen_schema

    def recorded(*args: object) -> torch.FunctionSchema:
        schemas.append(gen_schema(*args))
        return schemas[-1]

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    def loss(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        for weight in weights:
            x = block(x, weight)
        return x.sum()

    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    torch._dynamo.reset()
    with (pytest.MonkeyPatch.context() as patch,
          torch._functorch.config.patch(enable_autograd_cache=False)):
        patch.setattr(hop_utils, "materialize_as_graph",
                      lambda *args, **kwargs: traces.append(1) or materialize(*args, **kwargs))
        patch.setattr(InvokeSubgraphHOP, "gen_schema", recorded)
        torch.compile(loss, backend="aot_eager", fullgraph=True)(torch.randn(4, 8), weights).backward()
    assert all(weight.grad is not None for weight in weights)
    return len(traces), [str(schema) for schema in schemas]


def _unpatched_region_schemas() -> tuple[int, list[str]]:
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    assert _torch_patches.memoize_region_schemas()
    with pytest.MonkeyPatch.context() as unpatched:
        unpatched.setattr(InvokeSubgraphHOP, "gen_schema", InvokeSubgraphHOP.gen_schema.__wrapped__)
        return _region_schema_traces()


def test_torch_still_traces_a_region_again_for_every_calls_schema() -> None:
    traces, schemas = _unpatched_region_schemas()
    assert traces == len(schemas) >= 6


def test_region_schema_built_once_per_argument_layout() -> None:
    assert _torch_patches.memoize_region_schemas()
    assert _torch_patches.memoize_region_schemas()  # again: no change
    # 3 calls of the forward region (the first one's input needs no gradient) and of
    # the backward region, in more than one AOTAutograd pass: far fewer layouts than
    # calls (4 on torch 2.13; how torch names and wraps the regions varies by version).
    traces, schemas = _region_schema_traces()
    unpatched_traces, unpatched_schemas = _unpatched_region_schemas()
    assert traces < len(schemas) and traces < unpatched_traces
    assert schemas == unpatched_schemas


# -- Dynamo compares every output of a Function's forward with every input ------------

class _Doubled(torch.autograd.Function):
    """Each input times two: outputs that are never inputs."""

    @staticmethod
    @_torch_patches.fresh_outputs
    def forward(ctx: object, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(t * 2 for t in inputs)

    @staticmethod
    def backward(ctx: object, *grads: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(g * 2 for g in grads)


def _forward_helper_bytecodes(count: int, helper: object | None) -> int:
    """Bytecodes Dynamo traces inside torch's forward helper (``torch/_functorch/
    autograd_function.py``) for one call of :class:`_Doubled` on ``count`` tensors,
    with ``helper`` in place of the installed one (``None``: the installed one); checks
    the compiled outputs and gradients against eager."""
    from torch._dynamo import symbolic_convert
    from torch._functorch.autograd_function import DynamoAutogradFunctionTraceHelper

    traced = [0]
    step = symbolic_convert.InstructionTranslatorBase.step

    def counted(self: symbolic_convert.InstructionTranslatorBase) -> object:
        if self.f_code.co_filename.endswith("autograd_function.py"):
            traced[0] += 1
        return step(self)

    def fn(*inputs: torch.Tensor) -> torch.Tensor:
        return sum(out.sum() for out in _Doubled.apply(*inputs))

    inputs = [torch.randn(3, requires_grad=True) for _ in range(count)]
    torch._dynamo.reset()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(symbolic_convert.InstructionTranslatorBase, "step", counted)
        if helper is not None:
            patch.setattr(DynamoAutogradFunctionTraceHelper, "fwd_trace_helper", helper)
        loss = torch.compile(fn, backend="aot_eager", fullgraph=True)(*inputs)
    loss.backward()
    assert loss.item() == pytest.approx(2 * sum(t.sum().item() for t in inputs), rel=1e-6, abs=1e-6)
    assert all(torch.equal(t.grad, torch.full((3,), 2.0)) for t in inputs)
    return traced[0]


needs_forward_helper = pytest.mark.skipif(
    not _torch_patches.trust_fresh_outputs(), reason="this torch has no traced forward helper")


@needs_forward_helper
def test_torch_still_compares_every_output_with_every_input() -> None:
    from torch._functorch.autograd_function import DynamoAutogradFunctionTraceHelper

    unpatched = DynamoAutogradFunctionTraceHelper.fwd_trace_helper.__wrapped__
    small, large = (_forward_helper_bytecodes(n, unpatched) for n in (4, 8))
    # At least 25 more per tensor (32 on torch 2.11's set lookups; 2.13's pairwise
    # comparisons: 547 and 1531 for 4 and 8 tensors).
    assert large - small >= 4 * 25


@needs_forward_helper
def test_fresh_outputs_skip_the_comparisons_and_keep_the_numbers() -> None:
    assert _torch_patches.trust_fresh_outputs()  # again: no change
    assert _forward_helper_bytecodes(8, None) == _forward_helper_bytecodes(4, None) < 50


# -- Inductor loads each ISA extension's test library in a child process -------------

def _advertises_avx512() -> bool:
    from fsdp_traceable import cpu_isa_probe

    cpu_vec_isa = cpu_isa_probe._probe_api()
    return cpu_vec_isa is not None and any(
        "avx512" in isa for isa in cpu_isa_probe._advertised(cpu_vec_isa))


needs_isa_load_checks = pytest.mark.skipif(
    not (_torch_patches.answer_isa_load_checks() and _advertises_avx512()),
    reason="this torch loads no ISA test library in a child process each time (2.14 keeps "
           "the outcome on disk), or no AVX-512 here")


def _isa_list_loads(loads: list[list[str]], answered: bool) -> int:
    """The child-process loads computing the ISA list with ``vec_isa_ok`` set takes."""
    from torch._inductor import cpu_vec_isa

    with (torch._inductor.config.patch({"cpp.vec_isa_ok": True}),
          _torch_patches.isa_load_checks_answered() if answered else contextlib.nullcontext()):
        assert cpu_vec_isa.valid_vec_isa_list()
    return len(loads)


@needs_isa_load_checks
def test_torch_still_loads_isa_extensions_in_child_processes(forgotten_cpu_isa_probe) -> None:
    loads, _ = forgotten_cpu_isa_probe
    assert _isa_list_loads(loads, answered=False) >= 1  # 3 on an AVX-512 BF16 + VNNI host


@needs_isa_load_checks
def test_isa_load_checks_answered_inside_the_context_only(forgotten_cpu_isa_probe) -> None:
    loads, forget = forgotten_cpu_isa_probe
    assert _isa_list_loads(loads, answered=True) == 0
    forget()
    assert _isa_list_loads(loads, answered=False) >= 1


# -- Inductor precompiles the C++ kernels' header before finding their libraries ------

needs_header_precompile = pytest.mark.skipif(
    not _torch_patches.skip_header_precompile_on_load(),
    reason="this torch precompiles no header, or keys a library by the header's path")


@needs_header_precompile
def test_torch_still_precompiles_the_header_before_finding_a_library() -> None:
    from torch._inductor import codecache

    source = inspect.getsource(codecache.CppPythonBindingsCodeCache.load_async)
    lookup = source.find("if key not in cls.cache")
    assert 0 <= lookup < source.find("_precompile_header(")


class _HeaderPrecompiled(Exception):
    pass


@needs_header_precompile
def test_header_precompile_skipped_inside_the_context_only(monkeypatch) -> None:
    from torch._inductor import codecache

    def precompiling(**options):
        raise _HeaderPrecompiled

    monkeypatch.setattr(codecache, "CppTorchDeviceOptions", precompiling)
    with _torch_patches.header_precompile_skipped() as skipped:
        assert skipped
        assert codecache._precompile_header("cpp_prefix.h", "no command line") is None
    with pytest.raises(_HeaderPrecompiled):  # torch's own runs again
        codecache._precompile_header("cpp_prefix.h", "no command line")
