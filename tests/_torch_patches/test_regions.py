"""The patches of ``fsdp_traceable/_torch_patches/regions.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pytest
import torch

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
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
