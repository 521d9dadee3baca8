"""The patch of ``fsdp_traceable/_torch_patches/whole_step_recompute.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable

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


def _sharded_whole_step() -> tuple[Transformer, Callable[[torch.Tensor], torch.Tensor]]:
    """A tiny transformer sharded per block and at the root (inside a process group),
    and its whole training step: forward, loss and ``backward()``."""
    config = TransformerConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8)
    torch.manual_seed(0)
    model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)

    def step(tokens: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, tokens)
        loss.backward()
        return loss.detach()

    return model, step


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward()")
def test_torch_still_refuses_a_whole_step_with_two_resharded_groups(monkeypatch) -> None:
    # fsdp_traceable.compile_step without the wrapped pass: each block's reduce-scatter,
    # in its autograd.Function's backward, splits the traced backward (2.12+); torch
    # 2.11's pass finds no backward at all (it looks for an annotation nothing sets
    # here) and re-gathers nothing, so every block's unsharded parameters live from
    # forward to backward.
    from torch._dynamo.backends.common import aot_autograd

    from fsdp_traceable._torch_patches.whole_step_recompute import _pass_reads_annotation
    from fsdp_traceable.fsdp import traced_step_passes

    _torch_patches.trace_backward_into_subclasses()
    _torch_patches.complete_whole_step_recompute()
    # (The forwards would put the wrapped pass back while Dynamo traces them.)
    monkeypatch.setattr(traced_step_passes, "prepare_traced_step", lambda: None)
    module = importlib.import_module(_torch_patches.REMAT_PASS_MODULE)
    patched = module.remat_using_tags_for_fwd_loss_bwd_graph
    graphs: list[fx.GraphModule] = []

    def keep(gm: fx.GraphModule, example_inputs: object) -> fx.GraphModule:
        graphs.append(gm)
        return gm

    with fake_process_group(2):
        model, step = _sharded_whole_step()
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


# -- ... put in place by a plain torch.compile of a whole step, for the package's graphs only

def _recorded_passes(monkeypatch) -> list[fx.GraphModule]:
    """The graphs the package's completion of torch's pass acts on, from now on, with
    the pass (and on torch 2.11 the wrap of Dynamo's ``backward()`` handler) unwrapped
    first, as in a process where compile_step never ran."""
    from fsdp_traceable._torch_patches import whole_step_recompute

    _torch_patches.complete_whole_step_recompute()
    module = importlib.import_module(_torch_patches.REMAT_PASS_MODULE)
    monkeypatch.setattr(module, "remat_using_tags_for_fwd_loss_bwd_graph",
                        module.remat_using_tags_for_fwd_loss_bwd_graph.__wrapped__)
    if _torch_patches.subclass_patch_needed():
        from torch._dynamo.variables import torch as torch_variables

        collect = torch_variables._collect_tensors_with_sources
        monkeypatch.setattr(torch_variables, "_collect_tensors_with_sources",
                            getattr(collect, "__wrapped__", collect))
    acted_on: list[fx.GraphModule] = []
    mark = whole_step_recompute.mark_backward_spans

    def recorded(gm: fx.GraphModule, **kwargs: object) -> int:
        acted_on.append(gm)
        return mark(gm, **kwargs)

    monkeypatch.setattr(whole_step_recompute, "mark_backward_spans", recorded)
    return acted_on


class _TagRecorder:
    """``aot_eager`` that records ``torch.compiler.config.cache_key_tag`` where
    AOTAutograd computes its cache key (the backend's call) and where Inductor would
    compute its own (the inference compiler's)."""

    def __init__(self) -> None:
        from torch._dynamo.backends.common import aot_autograd

        self.tags: list[tuple[str, str]] = []
        self._aot = aot_autograd(fw_compiler=self._compiler, inference_compiler=self._compiler)

    def _compiler(self, gm: fx.GraphModule, example_inputs: object) -> fx.GraphModule:
        self.tags[-1] = (self.tags[-1][0], torch.compiler.config.cache_key_tag)
        return gm

    def __call__(self, gm: fx.GraphModule, example_inputs: object) -> object:
        self.tags.append((torch.compiler.config.cache_key_tag, ""))
        return self._aot(gm, example_inputs)


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward()")
def test_plain_whole_step_compile_completes_the_pass_for_our_graphs_only(monkeypatch) -> None:
    # torch.compile of a whole step under trace_autograd_ops, not compile_step: the
    # fully_shard forwards put the pass in place while Dynamo traces them (without
    # forward regions torch alone refuses this graph: the test above), on torch 2.11
    # with Dynamo's backward() taking DTensors (torch alone fails with a bare
    # AssertionError), and key the compile's caches by the passes as compile_step does
    # (see [Note: graph passes in the cache key]); a user's own whole step in the same
    # process then gets torch's pass unchanged, and the user's tag.
    from fsdp_traceable.whole_step.graph_pass_key import keyed_by_graph_passes

    acted_on = _recorded_passes(monkeypatch)
    backend = _TagRecorder()
    tokens = torch.zeros(2, 8, dtype=torch.long)
    with (fake_process_group(2), torch._dynamo.config.patch(trace_autograd_ops=True),
          torch._functorch.config.patch(enable_autograd_cache=False),
          torch.compiler.config.patch(cache_key_tag="users-tag"),
          fsdp_traceable.config.patch(forward_regions=False)):
        with keyed_by_graph_passes():
            compile_steps_tag = torch.compiler.config.cache_key_tag
        model, step = _sharded_whole_step()
        torch.compile(step, backend=backend, fullgraph=True)(tokens)
        assert len(acted_on) == 1
        assert all(p.grad is not None for p in model.parameters())
        assert backend.tags == [(compile_steps_tag, compile_steps_tag)]
        assert compile_steps_tag.startswith("users-tag/fsdp_traceable-graph-passes-")
        assert torch.compiler.config.cache_key_tag == "users-tag"  # after the compile

        users = torch.nn.Linear(4, 4)
        reference = torch.nn.Linear(4, 4)
        reference.load_state_dict(users.state_dict())
        x = torch.randn(3, 4)

        def users_step(x: torch.Tensor) -> None:
            users(x).square().sum().backward()

        torch.compile(users_step, backend=backend, fullgraph=True)(x)
        reference(x).square().sum().backward()
        assert backend.tags[1:] == [("users-tag", "users-tag")]
    assert len(acted_on) == 1  # not the user's graph
    assert torch.equal(users.weight.grad, reference.weight.grad)


def test_plain_compiles_tag_is_put_back_at_each_compile_end() -> None:
    # (Without compiling: Dynamo's compile-end callbacks as a compile runs them.)
    # Also after torch._dynamo.reset(), which drops every callback.
    from torch._dynamo.callback import CallbackTrigger

    from fsdp_traceable.whole_step.graph_pass_key import key_this_compile_by_graph_passes, tagged

    config = torch.compiler.config
    with config.patch(cache_key_tag="users-tag"):
        for _ in range(2):
            torch._dynamo.reset()
            with torch._dynamo.callback_handler.install_callbacks(CallbackTrigger.DYNAMO, "0"):
                assert key_this_compile_by_graph_passes()
                assert key_this_compile_by_graph_passes()  # (each forward of a step calls it)
                assert config.cache_key_tag == tagged("users-tag") != "users-tag"
            assert config.cache_key_tag == "users-tag"
