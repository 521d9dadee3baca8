"""The patch of ``fsdp_traceable/_torch_patches/whole_step_recompute.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
import torch.fx as fx

import fsdp_traceable
from fsdp_traceable import _torch_patches
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.models.transformer import Transformer, TransformerConfig, shard_transformer
from fsdp_traceable.testing import count_collectives
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

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
