"""``benchmarks/plan_vs_run.py``, which ``make gpu-check`` runs on the GPU bench's workload:
the figures it compares are the ones each side's JSON means (the plan's peak above the
step's start, the bench's peak above it; the plan's estimate against the median step)."""

from __future__ import annotations

import importlib.util
import os

import pytest

_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "plan_vs_run.py")


def _load():
    spec = importlib.util.spec_from_file_location("plan_vs_run", _SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PLAN = {"setup": {"model": "transformer", "world_size": 1},
        "memory_per_rank_bytes": {"peak": 5_000, "step_start": 1_000},
        "estimate": {"gpu": "h100", "step_s": 0.002}}
BENCH = {"args": {"dim": 1024}, "provenance": {"commit": "abc1234"},
         "modes": {"eager": {"peak_bytes": 3_200, "median_step_ms": 2.5},
                   "compile-ca": {"peak_bytes": 1, "median_step_ms": 1.0}}}


def test_compares_the_peak_above_the_steps_start_and_the_step_time() -> None:
    report = _load().compare(PLAN, BENCH, "eager")
    assert report["peak_above_step_start_bytes"] == {"planned": 4_000, "measured": 3_200,
                                                     "ratio": 1.25}
    assert report["step_ms"] == {"gpu": "h100", "planned": 2.0, "measured": 2.5, "ratio": 0.8}
    assert report["bench_provenance"] == {"commit": "abc1234"}
    without_gpu = _load().compare({**PLAN, "estimate": None}, BENCH, "eager")
    assert "step_ms" not in without_gpu


def test_a_mode_the_bench_did_not_run_is_named() -> None:
    with pytest.raises(ValueError, match=r"no mode 'whole-step'.*'compile-ca', 'eager'"):
        _load().compare(PLAN, BENCH, "whole-step")
