"""The README's quickstart, run as it stands: the code block after ``<!-- quickstart -->``
is written to a file and launched on 2 gloo ranks with ``torch.distributed.run``, as the
README tells a user to run it; its printed losses (a whole-model Inductor compile, its
backward without compiled autograd) match the same training unsharded in one process."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fsdp_traceable.testing.local_ranks import free_port

pytestmark = [pytest.mark.gloo, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- quickstart -->"
# Torch's warning when a checkpointed region under torch.compile has a context_fn, which
# our recompute-in-backward region passes; fsdp_traceable drops it (the region holds no
# in-place ops).
CONTEXT_FN_WARNING = "Detected that context_fn is passed to torch.utils.checkpoint"


def quickstart_code() -> str:
    """The fenced code block that follows the quickstart marker in README.md."""
    readme = (ROOT / "README.md").read_text()
    assert readme.count(MARKER) == 1, f"README.md must hold exactly one {MARKER}"
    match = re.search(re.escape(MARKER) + r"\s*```python\n(.*?)\n```", readme, re.S)
    assert match, f"no ```python block right after {MARKER} in README.md"
    return match.group(1) + "\n"


def unsharded_reference_losses() -> list[float]:
    """The quickstart's three losses from one unsharded, uncompiled process: the same
    seed, model, data and optimizer, with no process group."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2)),
                          nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(8, 16), torch.randn(8, 1)
    losses = []
    for _ in range(3):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_quickstart_is_at_most_20_lines() -> None:
    assert len(quickstart_code().splitlines()) <= 20


def test_quickstart_runs_on_two_gloo_ranks(tmp_path: Path, run_inductor_cache_dir: Path) -> None:
    script = tmp_path / "quickstart.py"
    script.write_text(quickstart_code())
    env = {
        **os.environ,
        # This checkout's package, not another installed copy.
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        # The run's cache: Inductor's CPU probes there are already compiled.
        "TORCHINDUCTOR_CACHE_DIR": str(run_inductor_cache_dir),
        # Set, so torchrun prints no banner about it and stderr holds only the script's.
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(script)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    losses: dict[int, dict[int, float]] = {}
    # The ranks share one stdout: lines may interleave, so match the printed format
    # (``.4f``, or nan / inf), not whole lines.
    pattern = r"rank (\d+) step (\d+) loss (nan|-?inf|-?\d+\.\d{4})"
    for rank, step, loss in re.findall(pattern, proc.stdout):
        losses.setdefault(int(rank), {})[int(step)] = float(loss)
    assert sorted(losses) == [0, 1], proc.stdout
    assert all(sorted(steps) == [0, 1, 2] for steps in losses.values()), proc.stdout
    assert all(math.isfinite(v) for steps in losses.values() for v in steps.values())
    assert losses[0] == losses[1]  # one model, sharded: every rank sees the same loss
    # The sharded, compiled (Inductor) run trains as the unsharded model does: printed
    # to 4 decimals, so within half a unit of the last digit (and compile's 1e-6).
    for step, expected in enumerate(unsharded_reference_losses()):
        assert abs(losses[0][step] - expected) <= 5e-5 + 1e-6, (step, losses[0], expected)
    assert CONTEXT_FN_WARNING not in proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if "warn" in line.lower()]
    assert not warnings, proc.stderr
