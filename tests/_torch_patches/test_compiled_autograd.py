"""The patch of ``fsdp_traceable/_torch_patches/compiled_autograd.py`` (see this package's
``__init__``: ``test_torch_still_...`` checks torch still needs it)."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx

from fsdp_traceable import _torch_patches

compiled_autograd = torch._dynamo.compiled_autograd


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
