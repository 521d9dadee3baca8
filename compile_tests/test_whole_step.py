"""The whole training step as one graph (:func:`fsdp_traceable.compile_step`): forward,
loss and ``loss.backward()`` traced together, against torch's FSDP2 eager on 2 gloo
ranks (the built-in transformer and Hugging Face's ``LlamaForCausalLM``); its graph's
collectives and what it keeps from forward for backward, on the fake process group."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.distributed.tensor import DTensor

import fsdp_traceable
from compile_tests import whole_step_cases
from compile_tests.sharded_model import CONFIG, N_GROUPS, data, make_model
from compile_tests.test_fully_shard_compile import BLOCK_WEIGHT_SHAPES
from fsdp_traceable.models.transformer import Transformer, shard_transformer
from fsdp_traceable.testing import count_collectives
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from fsdp_traceable.tracing import regions_available
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors
from tests.whole_step_graphs import backward_nodes, kept_for_backward

needs_whole_step = pytest.mark.skipif(
    not dynamo_traces_backward_into_dtensors(),
    reason="this torch's Dynamo cannot trace backward() into DTensor parameters")
needs_keyed_regions = pytest.mark.skipif(
    not regions_available(), reason="this torch's nested_compile_region takes no reuse key")


@needs_whole_step
@pytest.mark.gloo
def test_whole_step_trains_like_fsdp2_eager_in_one_graph() -> None:
    # The built-in transformer per setting, and Hugging Face's Llama: bit for bit.
    # The default (blocks reshard, the root keeps its parameters) and no resharding;
    # True only adds the root to the re-gathered groups (the graph test below).
    settings = (None, False)
    with_llama = importlib.util.find_spec("transformers") is not None
    results = run_on_local_ranks(whole_step_cases.train_each, 2, settings, "aot_eager",
                                 with_llama, timeout_s=300)
    for rank, by_setting in enumerate(results):
        if with_llama:  # Hugging Face's LlamaForCausalLM, built on meta
            theirs, ours = by_setting["llama"]["theirs"], by_setting["llama"]["ours"]
            assert ours["frames"] == 1 and ours["graph_breaks"] == {}, f"rank {rank} llama"
            # Every decoder layer's forward calls the one region traced for the first.
            assert ours["regions"] == ((2, 1) if regions_available() else (0, 0)), f"rank {rank} llama"
            assert ours["losses"] == theirs["losses"], f"rank {rank} llama"
            for name, param in theirs["params"].items():
                assert torch.equal(ours["params"][name], param), f"rank {rank} llama {name}"
        for setting in settings:
            theirs, ours = by_setting[setting]["theirs"], by_setting[setting]["ours"]
            what = f"rank {rank} reshard_after_forward={setting}"
            assert ours["frames"] == 1 and ours["graph_breaks"] == {} and ours["regions"] == (0, 0), what
            assert ours["losses"] == theirs["losses"], what
            for name, (kind, placements, grad) in theirs["grads"].items():
                assert ours["grads"][name][:2] == (kind, placements), f"{what} {name}"
                assert torch.equal(ours["grads"][name][2], grad), f"{what} {name} grad"
            for name, param in theirs["params"].items():
                assert torch.equal(ours["params"][name], param), f"{what} {name}"
        if regions_available():
            # Under Inductor, each block's forward a call of one of two regions (plain,
            # checkpointed): eager's numbers within Inductor's rounding. What a region's
            # forward saves of its inputs for its backward stays alive to the backward
            # (see [Note: region outputs that are inputs]).
            theirs, ours = by_setting["inductor regions"]["theirs"], by_setting["inductor regions"]["ours"]
            what = f"rank {rank} inductor regions"
            assert ours["frames"] == 1 and ours["graph_breaks"] == {}, what
            assert ours["regions"] == (4, 2), what
            torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=0, atol=1e-5)
            for name, (kind, placements, grad) in theirs["grads"].items():
                assert ours["grads"][name][:2] == (kind, placements), f"{what} {name}"
                torch.testing.assert_close(ours["grads"][name][2], grad, rtol=0, atol=1e-5,
                                           msg=lambda m, n=name: f"{what} {n} grad: {m}")
            for name, param in theirs["params"].items():
                torch.testing.assert_close(ours["params"][name], param, rtol=0, atol=1e-5,
                                           msg=lambda m, n=name: f"{what} {n}: {m}")
        # The gradients clipped, then AdamW's update and zero_grad, in the graph, the
        # learning rate halved every step without a recompile: eager's numbers but for
        # the bias corrections, which the graph computes as tensors where eager takes
        # Python floats.
        theirs, ours = by_setting["optimizer in step"]["theirs"], by_setting["optimizer in step"]["ours"]
        what = f"rank {rank} optimizer in step"
        assert ours["frames"] == 1 and ours["graph_breaks"] == {}, what
        assert ours["cleared"] and theirs["cleared"], what
        torch.testing.assert_close(ours["losses"], theirs["losses"], rtol=0, atol=1e-5)
        torch.testing.assert_close(ours["norms"], theirs["norms"], rtol=1e-6, atol=0)
        assert min(theirs["norms"]) > whole_step_cases.MAX_NORM  # (so it clips)
        for name, param in theirs["params"].items():
            torch.testing.assert_close(ours["params"][name], param, rtol=0, atol=1e-5)
        assert ours["state"].keys() == theirs["state"].keys(), what
        for name, state in theirs["state"].items():
            steps = whole_step_cases.STEPS
            assert ours["state"][name]["step"] == state["step"] == steps, f"{what} {name}"
            for key in ("exp_avg", "exp_avg_sq"):
                torch.testing.assert_close(ours["state"][name][key], state[key],
                                           rtol=0, atol=1e-5)


class _InferenceGraph:
    """A backend keeping the graph AOTAutograd hands its inference compiler: the whole
    step after torch's forward-loss-backward recompute pass."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []
        self.backend = aot_autograd(fw_compiler=self._keep, inference_compiler=self._keep)

    def _keep(self, gm: torch.fx.GraphModule, example_inputs: object) -> torch.fx.GraphModule:
        self.graphs.append(gm)
        return gm


def _whole_step(reshard_after_forward: bool | None, backend: object) -> CompileCounterWithBackend:
    model = make_model(reshard_after_forward=reshard_after_forward)

    def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = model.loss(tokens, targets)
        loss.backward()
        return loss.detach()

    counter = CompileCounterWithBackend(backend)
    fsdp_traceable.compile_step(step, backend=counter)(*data())
    assert all(isinstance(p.grad, torch.distributed.tensor.DTensor) for p in model.parameters())
    return counter


def _gathers(gm: torch.fx.GraphModule) -> tuple[int, int]:
    """All-gathers in (forward, backward)."""
    nodes = [n for n in gm.graph.nodes
             if n.op == "call_function" and "all_gather_into_tensor" in str(n.target)]
    backward = len(backward_nodes(gm).intersection(nodes))
    return len(nodes) - backward, backward


# Dynamo's timings of a region traced, and of one reused (stamped out) by key.
_REGION_TRACES = ("invoke_subgraph_trace", "invoke_subgraph_reuse_stamp_out")


@needs_whole_step
@pytest.mark.parametrize("reshard_after_forward, regathered, forward_regions",
                         [(None, N_GROUPS - 1, False), (True, N_GROUPS, False),
                          (False, 0, False), (True, N_GROUPS, True)])
def test_whole_step_regathers_each_resharded_group_once_in_backward(
        fake_world: None, reshard_after_forward: bool | None, regathered: int,
        forward_regions: bool) -> None:
    # With forward regions (2 layers: 2 region calls of one region, each way) the
    # backward still re-gathers: it reads each block's parameters from the re-gather,
    # not from what the forward region returned.
    if forward_regions and not regions_available():
        pytest.skip("this torch's nested_compile_region takes no reuse key")
    capture = _InferenceGraph()
    timings = torch._dynamo.utils.compilation_time_metrics
    traced_before = {name: len(timings.get(name, [])) for name in _REGION_TRACES}
    with fsdp_traceable.config.patch(forward_regions=forward_regions):
        counter = _whole_step(reshard_after_forward, capture.backend)
    traced = {name: len(timings.get(name, [])) - traced_before[name] for name in _REGION_TRACES}
    # Dynamo traced the forward region for the first block and stamped it out for the
    # others, and the copy-in and copy-out regions once per bucket layout (the root's, a
    # block's) and stamped out the block's for the other blocks.
    assert traced == ({"invoke_subgraph_trace": 1 + 2 * 2,
                       "invoke_subgraph_reuse_stamp_out": 3 * (CONFIG.n_layers - 1)}
                      if forward_regions else dict.fromkeys(_REGION_TRACES, 0))
    assert counter.frame_count == 1 and not counters["graph_break"]
    (graph,) = capture.graphs
    region_calls = [n for n in graph.graph.nodes
                    if n.target is torch.ops.higher_order.invoke_subgraph]
    copy_outs = [n for n in region_calls if any(
        "wait_tensor" in str(a.target) for a in n.all_input_nodes)]
    copy_ins = [n for n in region_calls if any(
        "all_gather_into_tensor" in str(u.target) for item in n.users for u in item.users)]
    block_calls = [n for n in region_calls if n not in copy_outs and n not in copy_ins]
    # One forward and one backward call per block, of one region each; per block, a
    # copy-in and a copy-out call for its all-gather and for its re-gather, of one region
    # each (the root's copies, which its autograd.Function holds outside a recompute
    # region, AOTAutograd inlines).
    assert len(block_calls) == (2 * CONFIG.n_layers if forward_regions else 0)
    assert len({n.args[0].target for n in block_calls}) == (2 if forward_regions else 0)
    for copies in (copy_ins, copy_outs):
        assert len(copies) == (2 * CONFIG.n_layers if forward_regions else 0)
        assert len({n.args[0].target for n in copies}) == (1 if forward_regions else 0)
    assert _gathers(graph) == (N_GROUPS, regathered)
    assert count_collectives(graph)["reduce_scatter"] == N_GROUPS
    kept_weights = [s for s in kept_for_backward(graph) if s in BLOCK_WEIGHT_SHAPES]
    if regathered:
        assert kept_weights == []  # no block's unsharded weight lives across
    else:
        # Every block's 7 matrices (q, k, v, o, w1, w2, w3), kept in some layout.
        assert len(kept_weights) >= 7 * CONFIG.n_layers


@needs_whole_step
@pytest.mark.skipif(regions_available(), reason="this torch keys regions")
def test_forward_regions_name_the_torch_they_need() -> None:
    step = fsdp_traceable.compile_step(lambda x: x + 1)
    with fsdp_traceable.config.patch(forward_regions=True):
        with pytest.raises(RuntimeError, match=r"forward_regions needs a torch .*\(2\.13 or newer\)"):
            step(torch.ones(2))


def test_compile_step_names_the_torch_it_needs(monkeypatch) -> None:
    # (Every supported torch traces backward(); older ones get this error.)
    from fsdp_traceable.whole_step import capture

    monkeypatch.setattr(capture, "dynamo_traces_backward_into_dtensors", lambda: False)
    with pytest.raises(RuntimeError, match=r"trace_autograd_ops, 2\.11 or newer"):
        fsdp_traceable.compile_step(lambda: None)


def test_compile_step_rejects_what_is_not_a_function() -> None:
    with pytest.raises(TypeError, match=r"compile_step\(step=...\)"):
        fsdp_traceable.compile_step(42)


@needs_whole_step
def test_whole_step_follows_changing_shapes_after_another_model(fake_world: None) -> None:
    # A second model's step, compiled after the first one's in the same process, and
    # batch and sequence sizes that change between steps: no graph break, each step's
    # gradients are DTensors; the first model recompiles once per newly dynamic size,
    # the second starts from the dims Dynamo already marks dynamic for this code.
    frames = []
    one_block = dataclasses.replace(CONFIG, n_layers=1)
    for config in (one_block, dataclasses.replace(one_block, vocab_size=64, dim=32, hidden_dim=None)):
        torch.manual_seed(0)
        model = shard_transformer(Transformer(config), fsdp_traceable.fully_shard)

        def step(tokens: torch.Tensor, targets: torch.Tensor, model=model) -> torch.Tensor:
            loss = model.loss(tokens, targets)
            loss.backward()
            return loss.detach()

        counter = CompileCounterWithBackend("aot_eager")
        compiled = fsdp_traceable.compile_step(step, backend=counter)
        for batch, seq in ((2, 12), (3, 12), (4, 8)):
            tokens = torch.randint(0, config.vocab_size, (batch, seq))
            compiled(tokens, tokens)
            assert all(isinstance(p.grad, DTensor) for p in model.parameters()), (batch, seq)
            model.zero_grad()
        frames.append(counter.frame_count)
    assert frames == [3, 1] and not counters["graph_break"]


class _DictBlock(torch.nn.Module):
    """Returns what torch's regions cannot: a dict holding a ``None`` and its own input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> dict:
        return {"hidden": torch.tanh(self.linear(x)), "aux": None, "residual": x, "layer": 0}


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(8, 8)  # so that both blocks' inputs require grad
        self.blocks = torch.nn.ModuleList([_DictBlock(), _DictBlock()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            out = block(x)
            assert out["aux"] is None and out["layer"] == 0
            x = out["hidden"] + out["residual"]
        return x.square().sum()


@needs_whole_step
@needs_keyed_regions
def test_forward_regions_return_what_torchs_regions_cannot(one_gloo_rank: None) -> None:
    # Each block's output, a dict with a None, a constant and the block's own input, is
    # rebuilt around the region: the step matches the eager step bit for bit, and the
    # second block reuses the first one's region.
    x = torch.randn(4, 8)
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = _Stack()
        for block in model.blocks:
            fsdp_traceable.fully_shard(block)
        fsdp_traceable.fully_shard(model)

        def step(x: torch.Tensor, model: _Stack = model) -> torch.Tensor:
            loss = model(x)
            loss.backward()
            return loss.detach()

        timings = torch._dynamo.utils.compilation_time_metrics
        before = {name: len(timings.get(name, [])) for name in _REGION_TRACES}
        with fsdp_traceable.config.patch(forward_regions=True):
            loss = (fsdp_traceable.compile_step(step, backend="aot_eager") if compiled
                    else step)(x)
        traced = {name: len(timings.get(name, [])) - before[name] for name in _REGION_TRACES}
        # The forward region traced once and stamped out once, and the copy-in and
        # copy-out regions traced once and stamped out twice each (the root's layout is
        # the blocks').
        assert traced == ({"invoke_subgraph_trace": 1 + 2,
                           "invoke_subgraph_reuse_stamp_out": 1 + 2 * 2}
                          if compiled else dict.fromkeys(_REGION_TRACES, 0))
        results.append((loss, [p.grad.full_tensor() for p in model.parameters()]))
    (loss, grads), (region_loss, region_grads) = results
    assert torch.equal(loss, region_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, region_grads, strict=True))


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor


class _OddBlock(torch.nn.Module):
    """Returns what a forward region cannot: an object, or a view of its input."""

    def __init__(self, output: str) -> None:
        super().__init__()
        self.output = output
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> object:
        hidden = self.linear(x)
        return _Output(hidden) if self.output == "object" else (hidden, x.t())


@needs_whole_step
@needs_keyed_regions
@pytest.mark.parametrize("output, message", [
    ("object", r"this forward's output holds a '_Output' object.*forward_regions = False"),
    ("view", r"returned a view of its input.*forward_regions = False"),
])
def test_forward_regions_name_the_switch_for_an_output_they_cannot_return(
        fake_world: None, output: str, message: str) -> None:
    block = fsdp_traceable.fully_shard(_OddBlock(output))

    def step(x: torch.Tensor) -> None:
        out = block(x)
        (out.hidden if output == "object" else out[0]).sum().backward()

    # On by default (torch 2.13+): the error says which switch turns regions off.
    assert fsdp_traceable.config.forward_regions is None
    with pytest.raises(Exception, match=message):
        fsdp_traceable.compile_step(step, backend="aot_eager")(torch.randn(2, 8))


def test_side_effect_records_are_kept_only_where_something_reads_them(
        tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from fsdp_traceable.whole_step.capture import _dynamo_settings

    def policy() -> str:
        with torch._dynamo.config.patch(_dynamo_settings()):
            assert torch._dynamo.config.trace_autograd_ops
            return torch._dynamo.config.side_effect_replay_policy

    for variable in ("TORCH_TRACE", "TORCH_DTRACE", "TORCH_COMPILE_DEBUG"):
        monkeypatch.delenv(variable, raising=False)
    assert policy() == "silent"
    torch._logging.set_logs(side_effects=True)
    try:
        assert policy() == "info"
    finally:
        torch._logging.set_logs()
    with torch._dynamo.config.patch(side_effect_replay_policy="warn"):
        assert policy() == "warn"
    monkeypatch.setenv("TORCH_TRACE", str(tmp_path))
    assert policy() == "info"
