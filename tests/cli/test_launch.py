"""Device choice for the commands, checked before any rank starts."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch

from fsdp_traceable.cli.bench import MODES
from fsdp_traceable.cli.launch import resolve_device, run_on_ranks
from fsdp_traceable.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


def test_auto_is_cpu_outside_torchrun(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    assert resolve_device("auto") == "cpu"
    assert resolve_device("cpu") == "cpu"


def test_unknown_device_is_rejected():
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda', got 'tpu'"):
        resolve_device("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_cuda_without_a_gpu_fails_before_spawning():
    with pytest.raises(ValueError, match="--device cuda needs a GPU"):
        run_on_ranks(print, "never runs", device="cuda")
    with pytest.raises(ValueError, match="--device cuda needs a GPU"):
        main(["bench", "--device", "cuda", "--world-size", "1"])


def test_gpu_check_script_parses_and_names_bench_modes_that_exist():
    script = ROOT / "benchmarks" / "gpu_check.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    modes = re.findall(r"--modes (\S+)", script.read_text())
    assert modes and all(set(listed.split(",")) <= set(MODES) for listed in modes)
