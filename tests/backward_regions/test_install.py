"""``install``: the hook into compiled autograd is wrapped once, consults its predicates
once per compiled function, and returns graphs untouched where it is off."""

from __future__ import annotations

import importlib
from weakref import WeakKeyDictionary

import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode

import fsdp_traceable
from fsdp_traceable.backward_regions import install, supported

compiled_autograd = torch._dynamo.compiled_autograd
install_module = importlib.import_module("fsdp_traceable.backward_regions.install")


@pytest.fixture(autouse=True)
def _fresh_hook_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """No predicate or cached graph from other tests (fully_shard installs its own)."""
    monkeypatch.setattr(install_module, "_predicates", [])
    monkeypatch.setattr(install_module, "_outlined", WeakKeyDictionary())


def _backward_graph() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode():
        x.meta["val"] = torch.empty(4, 4)
        y = graph.call_function(torch.ops.aten.mm.default, (x, x))
        y.meta["val"] = torch.empty(4, 4)
    graph.output((y,))
    return fx.GraphModule(torch.nn.Module(), graph)


class _CompiledFunction:
    """Stands in for an AOT compiled function: the hook keys its cache on the class."""


def test_this_torch_supports_the_hook() -> None:
    assert supported()


def test_wrapped_once_and_each_compiled_function_judged_once(monkeypatch) -> None:
    backward = _backward_graph()
    monkeypatch.setattr(compiled_autograd, "extract_bw_module", lambda cls: backward)
    seen = []

    def pick(compiled_function: type, gm: fx.GraphModule) -> bool:
        seen.append((compiled_function, gm))
        return True

    assert install(pick)
    wrapper = compiled_autograd.extract_bw_module
    assert install(pick)  # a second install neither wraps again nor adds the predicate
    assert compiled_autograd.extract_bw_module is wrapper
    outlined = wrapper(_CompiledFunction)
    assert outlined is not backward and wrapper(_CompiledFunction) is outlined
    assert seen == [(_CompiledFunction, backward)]
    with fsdp_traceable.config.patch(backward_regions=False):
        assert wrapper(_CompiledFunction) is backward


def test_graphs_no_predicate_picks_come_back_as_they_are(monkeypatch) -> None:
    backward = _backward_graph()
    monkeypatch.setattr(compiled_autograd, "extract_bw_module", lambda cls: backward)
    install(lambda compiled_function, gm: False)

    class Other:
        pass

    assert compiled_autograd.extract_bw_module(Other) is backward
