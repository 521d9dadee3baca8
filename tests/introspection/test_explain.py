"""``fsdp_traceable.explain`` on tiny models: its counts, collective sizes (against
sizes computed from the unsharded parameters), dump files, and the CLI."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fsdp_traceable.cli.main import main
from fsdp_traceable.introspection.explain import explain
from fsdp_traceable.models.transformer import Transformer, TransformerConfig
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

CONFIG = TransformerConfig(vocab_size=64, dim=16, n_layers=1, n_heads=4, max_seq_len=8)
WORLD = 2


def _shard_bytes(params: list[torch.Tensor]) -> int:
    """One rank's padded shard bytes of a group: dim 0 rounded up to ``WORLD`` rows."""
    return sum(-(-p.shape[0] // WORLD) * math.prod(p.shape[1:]) * p.element_size() for p in params)


def _group_bytes() -> tuple[int, int]:
    model = Transformer(CONFIG)
    block = list(model.layers[0].parameters())
    block_ids = {id(p) for p in block}
    root = [p for p in model.parameters() if id(p) not in block_ids]
    return _shard_bytes(root), _shard_bytes(block)


@pytest.fixture(autouse=True)
def no_process_group_left():
    """explain() destroys the fake process group it starts, and only that one."""
    initialized = dist.is_initialized()
    yield
    assert dist.is_initialized() == initialized


@pytest.mark.slow
def test_explain_inductor_compiled_autograd(tmp_path) -> None:
    report = explain(config=CONFIG, world_size=WORLD, out_dir=tmp_path, steps=2)
    root, block = _group_bytes()

    # One forward frame, one compiled-autograd backward graph, nothing recompiled.
    assert [frame.name for frame in report.frames] == ["forward_loss", "forward"]
    assert report.recompiles == [] and report.graph_breaks.count == 0
    assert report.compiled_autograd_captures == 1
    assert [g.stage for g in report.graphs] == [
        "dynamo", "aot_forward", "post_grad_forward",
        "dynamo", "aot_inference", "post_grad_inference",
    ]
    # Forward: the root's and the block's all-gather, in that order.
    (forward,) = report.graphs_of("aot_forward")
    assert [(c.kind, c.input_bytes, c.output_bytes) for c in forward.collectives] == [
        ("all_gather", root, WORLD * root), ("all_gather", block, WORLD * block)]
    # Backward (compiled autograd, one inference graph): the block is gathered again,
    # then the block's and the root's gradients are reduce-scattered.
    (backward,) = report.graphs_of("aot_inference")
    assert [(c.kind, c.input_bytes) for c in backward.collectives] == [
        ("all_gather", block), ("reduce_scatter", WORLD * block), ("reduce_scatter", WORLD * root)]
    # Each all-gather input is written by one Inductor kernel and its output read by one.
    forward_code, backward_code = report.copies
    assert forward_code[0].stage == "forward"
    assert [(len(c.copy_in), len(c.copy_out)) for c in forward_code[1]] == [(1, 1), (1, 1)]
    # With Inductor's default peak-memory reordering each gradient is copied into the
    # reduce-scatter input right after the kernel computing it: several kernels per
    # group (one with inductor_options(overlap=False), compile_tests/test_inductor_code.py).
    assert backward_code[0].stage == "inference"
    assert [(c.kind, len(c.copy_in), len(c.copy_out)) for c in backward_code[1]] == [
        ("all_gather", 1, 1), ("reduce_scatter", 3, 0), ("reduce_scatter", 2, 0)]

    names = sorted(path.name for path in report.files)
    assert names == sorted([
        "dynamo_graph_0.py", "dynamo_graph_1.py", "aot_forward_graph_0.py",
        "post_grad_forward_graph_0.py", "aot_inference_graph_0.py",
        "post_grad_inference_graph_0.py", "output_code_0_forward.py",
        "output_code_1_inference.py", "report.txt",
    ])
    assert all(path.parent == tmp_path and path.stat().st_size > 0 for path in report.files)
    assert "all_gather_into_tensor" in (tmp_path / "aot_forward_graph_0.py").read_text()
    assert "def call(" in (tmp_path / "output_code_0_forward.py").read_text()
    text = str(report)
    assert (tmp_path / "report.txt").read_text() == text + "\n"
    assert "Graph breaks: 0" in text and "(recompiles: 0)" in text
    # Inductor's defaults wait for every collective before any compute reads anything.
    assert [[(o.kind, o.compute) for o in overlaps] for _, overlaps in report.overlaps] == [
        [("all_gather", []), ("all_gather", [])],
        [("all_gather", []), ("reduce_scatter", []), ("reduce_scatter", [])]]
    assert "Compute between each collective's start and its wait:" in text


def test_explain_user_model_aot_eager_without_compiled_autograd() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    report = explain(model, inputs=(torch.randn(4, 6),), steps=3, compiled_autograd=False,
                     inductor=False)
    # The whole model is one group (the root): gathered in forward, kept for backward.
    assert report.recompiles == [] and report.graph_breaks.count == 0
    assert report.compiled_autograd_captures == 0
    assert [g.stage for g in report.graphs] == ["dynamo", "aot_forward", "aot_backward"]
    (forward,) = report.graphs_of("aot_forward")
    (backward,) = report.graphs_of("aot_backward")
    shard = _sharded_numel([(5, 6), (5,), (3, 5), (3,)]) * 4
    assert [(c.kind, c.input_bytes) for c in forward.collectives] == [("all_gather", shard)]
    assert [(c.kind, c.output_bytes) for c in backward.collectives] == [("reduce_scatter", shard)]
    assert report.files == [] and report.output_code == []


def _sharded_numel(shapes: list[tuple[int, ...]]) -> int:
    return sum(-(-s[0] // WORLD) * math.prod(s[1:]) for s in shapes)


def test_cli_explain_prints_the_report_and_writes_dumps(tmp_path, capsys) -> None:
    code = main(["explain", "--layers", "1", "--dim", "16", "--steps", "1", "--aot-eager",
                 "--inductor-options", "--out", str(tmp_path)])
    printed = capsys.readouterr().out
    assert code == 0
    assert printed.startswith("fsdp_traceable explain: 2 ranks, 1 steps, compiled autograd on")
    assert printed.splitlines()[1] == (
        "Inductor config: reorder_for_compute_comm_overlap=True, "
        "reorder_for_compute_comm_overlap_passes=['sink_waits', 'raise_comms', "
        "'reorder_compute_for_overlap'], post_grad_custom_post_pass=CompiledAutogradOverlap(), "
        "reorder_for_peak_memory=False, emulate_precision_casts=True")
    assert (tmp_path / "report.txt").read_text() == printed
    assert (tmp_path / "dynamo_graph_0.py").exists()


@pytest.mark.skipif(not dynamo_traces_backward_into_dtensors(),
                    reason="this torch's Dynamo cannot trace backward()")
def test_cli_explains_the_whole_step_as_one_graph(capsys) -> None:
    assert main(["explain", "--layers", "2", "--dim", "16", "--steps", "2", "--aot-eager",
                 "--whole-step"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("fsdp_traceable explain: 2 ranks, 2 steps, whole step as one "
                              "graph, aot_eager")
    assert "Frames compiled: 1 (recompiles: 0)" in printed and "Graph breaks: 0" in printed
    # One graph: 3 all-gathers, each block's again, 3 reduce-scatters.
    (inference,) = [line for line in printed.splitlines() if "aot_inference" in line]
    assert "all_gather x5" in inference and "reduce_scatter x3" in inference


def test_explain_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="pass compiled_autograd=False with it"):
        explain(whole_step=True)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        explain(steps=0)
    with pytest.raises(ValueError, match="world_size must be an int >= 1"):
        explain(world_size=0)
    with pytest.raises(TypeError, match="model must be an nn.Module"):
        explain(model="transformer")
    with pytest.raises(ValueError, match="inputs is required for a Linear"):
        explain(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="pass either model or config"):
        explain(Transformer(CONFIG), config=CONFIG)
    with pytest.raises(ValueError, match="--dim must be a positive multiple of 4"):
        main(["explain", "--dim", "6"])
