"""The GPU benchmark script's CPU side: buckets, layouts, tile tables and the
implementations' closures (checked bit for bit in the Triton interpreter)."""

from __future__ import annotations

import json

import pytest

from tests.benchmarks.scripts import benchmark_script

pytestmark = pytest.mark.triton
pytest.importorskip("triton", reason="triton is not installed")

@pytest.fixture(scope="module")
def gpu_check():
    with benchmark_script("gpu_check") as module:
        yield module


def test_dry_run_builds_every_bucket_and_checks_bits(gpu_check, tmp_path):
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--dry-run", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["measured"] is False and report["peak_bandwidth"] == 4.8e12
    checked = [r for r in report["results"] if "bitwise_equal" in r]
    assert len(checked) == 6 and all(r["bitwise_equal"] for r in checked)
    assert {r["params"] for r in report["results"]} == {9, 100, 1000}
    assert all(r["tiles"] for r in report["results"] if r["impl"] == "-")
    assert [len(gpu_check.make_bucket(n)) for n in (9, 100, 1000)] == [9, 100, 1000]


def test_peak_bandwidth_by_device_name(gpu_check):
    assert gpu_check.peak_bandwidth(None, "NVIDIA H100 80GB HBM3") == (3.35e12, "default for H100")
    assert gpu_check.peak_bandwidth(None, "NVIDIA H200")[0] == 4.8e12
    assert gpu_check.peak_bandwidth(2e12, "NVIDIA H200") == (2e12, "--peak-bandwidth")
