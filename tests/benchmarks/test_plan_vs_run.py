"""``benchmarks/plan_vs_run.py``, which ``make gpu-check`` runs on the GPU bench's workload:
the figures it compares are the ones each side's JSON means (the plan's peak above the
step's start, the bench's peak above it; the plan's estimate against the median step)."""

from __future__ import annotations

import pytest

from tests.benchmarks.scripts import benchmark_script


@pytest.fixture(scope="module")
def plan_vs_run():
    with benchmark_script("plan_vs_run") as module:
        yield module


PLAN = {"setup": {"model": "transformer", "world_size": 1},
        "memory_per_rank_bytes": {"peak": 5_000, "step_start": 1_000},
        "estimate": {"gpu": "h100", "step_s": 0.002}}
BENCH = {"args": {"dim": 1024}, "provenance": {"commit": "abc1234"},
         "modes": {"eager": {"peak_bytes": 3_200, "median_step_ms": 2.5},
                   "compile-ca": {"peak_bytes": 1, "median_step_ms": 1.0}}}


def test_compares_the_peak_above_the_steps_start_and_the_step_time(plan_vs_run) -> None:
    report = plan_vs_run.compare(PLAN, BENCH, "eager")
    assert report["peak_above_step_start_bytes"] == {"planned": 4_000, "measured": 3_200,
                                                     "ratio": 1.25}
    assert report["step_ms"] == {"gpu": "h100", "planned": 2.0, "measured": 2.5, "ratio": 0.8}
    assert report["bench_provenance"] == {"commit": "abc1234"}
    without_gpu = plan_vs_run.compare({**PLAN, "estimate": None}, BENCH, "eager")
    assert "step_ms" not in without_gpu


def test_a_mode_the_bench_did_not_run_is_named(plan_vs_run) -> None:
    with pytest.raises(ValueError, match=r"no mode 'whole-step'.*'compile-ca', 'eager'"):
        plan_vs_run.compare(PLAN, BENCH, "whole-step")
