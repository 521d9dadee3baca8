"""The patches of ``fsdp_traceable/_torch_patches/regions.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pytest
import torch

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.tracing import constant_result
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

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


# -- A user's reused region in the same process: as torch leaves it ------------------

def _users_reused_region_grads() -> list[bool]:
    """A user's region called twice in a whole step (the second call reused by Dynamo),
    compiled after a ``fully_shard`` call: whether each call's weight got a gradient."""

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(2)]

    def step(x: torch.Tensor) -> None:
        for weight in weights:
            x = block(x, weight)
        x.sum().backward()

    torch._dynamo.reset()
    with torch._dynamo.config.patch(trace_autograd_ops=True):
        torch.compile(step, backend="aot_eager", fullgraph=True)(torch.randn(4, 8))
    return [weight.grad is not None for weight in weights]


@needs_keyed_regions
def test_users_reused_region_is_left_as_torch_leaves_it(monkeypatch) -> None:
    from torch._dynamo.variables import invoke_subgraph as dynamo_invoke_subgraph

    with fake_process_group(2):
        shard_transformer(Transformer(TransformerConfig(n_layers=2, dim=16)),
                          fsdp_traceable.fully_shard)  # applies the patch
    assert getattr(dynamo_invoke_subgraph.stamp_out_subgraph, "_fsdp_traceable_links", False)
    patched = _users_reused_region_grads()
    monkeypatch.setattr(dynamo_invoke_subgraph, "stamp_out_subgraph",
                        dynamo_invoke_subgraph.stamp_out_subgraph.__wrapped__)
    assert patched == _users_reused_region_grads()


# -- Every region call that needs a gradient traces the region again for its schema ---

def _schema_traces(run: object, unpatched: bool = False) -> tuple[int, list[str]]:
    """``run()`` compiles a whole step calling one region several times with one argument
    layout; returns how often a region's graph was traced again to build a call's
    schema, and the schemas built (``unpatched``: with torch's ``gen_schema``)."""
    from torch._higher_order_ops import utils as hop_utils
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    assert _torch_patches.memoize_region_schemas()
    traces, schemas = [], []
    materialize = hop_utils.materialize_as_graph
    gen_schema = (InvokeSubgraphHOP.gen_schema.__wrapped__ if unpatched
                  else InvokeSubgraphHOP.gen_schema)

    def recorded(*args: object) -> torch.FunctionSchema:
        schemas.append(gen_schema(*args))
        return schemas[-1]

    torch._dynamo.reset()
    with (pytest.MonkeyPatch.context() as patch,
          torch._functorch.config.patch(enable_autograd_cache=False)):
        patch.setattr(hop_utils, "materialize_as_graph",
                      lambda *args, **kwargs: traces.append(1) or materialize(*args, **kwargs))
        patch.setattr(InvokeSubgraphHOP, "gen_schema", recorded)
        run()
    return len(traces), [str(schema) for schema in schemas]


def _users_region_step() -> None:
    """A user's region called three times, then backward (not a whole step)."""

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    def loss(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        for weight in weights:
            x = block(x, weight)
        return x.sum()

    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    torch.compile(loss, backend="aot_eager", fullgraph=True)(torch.randn(4, 8), weights).backward()
    assert all(weight.grad is not None for weight in weights)


@constant_result
def _as_the_packages() -> bool:
    """Marks the compile tracing this call as the package's, as a ``fully_shard``
    forward does (``fsdp/traced_step_passes.py``)."""
    return _torch_patches.mark_package_compile()


def _package_regions_step() -> None:
    """:func:`_users_region_step`'s regions in a compile the package's forward marked."""

    @torch.compiler.nested_compile_region
    def block(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ weight)

    def loss(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        _as_the_packages()
        for weight in weights:
            x = block(x, weight)
        return x.sum()

    weights = [torch.randn(8, 8, requires_grad=True) for _ in range(3)]
    torch.compile(loss, backend="aot_eager", fullgraph=True)(torch.randn(4, 8), weights).backward()


def test_torch_still_traces_a_region_again_for_every_calls_schema() -> None:
    traces, schemas = _schema_traces(_users_region_step, unpatched=True)
    assert traces == len(schemas) >= 6


def test_users_region_schema_traced_as_torch_traces_it() -> None:
    # The patch in place (the package's fully_shard applied it), a user's region: as torch.
    with fake_process_group(2):
        shard_transformer(Transformer(TransformerConfig(n_layers=1, dim=16)),
                          fsdp_traceable.fully_shard)
    assert _schema_traces(_users_region_step) == _schema_traces(_users_region_step, unpatched=True)


def test_package_region_schema_built_once_per_argument_layout() -> None:
    assert _torch_patches.memoize_region_schemas()  # again: no change
    traces, schemas = _schema_traces(_package_regions_step)
    unpatched_traces, unpatched_schemas = _schema_traces(_package_regions_step, unpatched=True)
    assert traces < len(schemas) and traces < unpatched_traces
    assert schemas == unpatched_schemas
