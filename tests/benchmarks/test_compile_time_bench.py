"""The compile-time benchmark's bookkeeping: ratios against the unsharded compile, the
error summary a failed configuration records, and the plot."""

from __future__ import annotations

import pathlib

import pytest

from tests.benchmarks.scripts import benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("compile_time_bench") as module:
        yield module


def _row(config: str, layers: int, first: float) -> dict:
    return {"config": config, "layers": layers, "cold": {"first_step_s": first}}


def test_ratios_are_against_unsharded_at_the_same_depth_and_growth_from_the_smallest(bench):
    rows = [
        _row("unsharded-whole", 4, 10.0), _row("unsharded-whole", 16, 20.0),
        _row("ours-blocks-aot", 4, 5.0), _row("ours-blocks-aot", 16, 6.0),
        {"config": "unsharded-regions", "layers": 4, "cold": {"error": "boom"}},
    ]
    ratios = bench._ratios(rows)["ratios"]
    assert ratios["ours-blocks-aot"]["vs_unsharded_whole"] == {4: 0.5, 16: 0.3}
    assert ratios["ours-blocks-aot"]["growth_from_L4"] == {4: 1.0, 16: 1.2}
    assert ratios["unsharded-whole"]["growth_from_L4"] == {4: 1.0, 16: 2.0}
    assert "unsharded-regions" not in ratios  # a failed configuration has no figures


def test_every_step_configuration_compiles_the_whole_step(bench):
    modes = {config: bench._compile_mode(config) for config in bench.CONFIGS}
    assert {c for c, mode in modes.items() if mode == "step"} == {
        "ours-step", "ours-step-regions", "ours-step-saved", "ours-step-saved-header",
        "unsharded-step"}
    assert {c for c, mode in modes.items() if mode == "whole"} == {
        "ours-whole", "unsharded-whole", "unsharded-regions"}


def test_error_summary_keeps_the_exception_and_dynamos_explanation(bench):
    stderr = "\n".join([
        "Traceback (most recent call last):",
        '[rank0]:   File "x.py", line 3, in <module>',
        "[rank0]: torch._dynamo.exc.Unsupported: Attempted to wrap invoke_subgraph",
        "[rank0]:   Explanation: Directly using invoke_subgraph is not supported.",
        "[rank0]: Set TORCHDYNAMO_VERBOSE=1 for the internal stack trace",
    ])
    assert bench._error_summary(stderr) == (
        "torch._dynamo.exc.Unsupported: Attempted to wrap invoke_subgraph\n"
        "Explanation: Directly using invoke_subgraph is not supported."
    )
    # Nothing recognisable: the last lines as they are.
    assert bench._error_summary("a\nb\nc") == "a\nb\nc"


def test_plot_draws_every_configuration_with_figures(bench, tmp_path):
    pytest.importorskip("matplotlib")
    report = {"date": "2026-12-01T00:00:00+00:00", "rows": [
        _row("unsharded-whole", 4, 10.0), _row("unsharded-whole", 8, 14.0),
        {"config": "unsharded-regions", "layers": 4, "cold": {"error": "boom"}},
    ]}
    png = bench._plot(report, str(tmp_path / "compile_time_bench.json"))
    assert png == str(tmp_path / "compile_time_bench.png")
    assert pathlib.Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
