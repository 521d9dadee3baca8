"""``TORCH_LOGS="+fsdp_traceable"`` shows the package's debug logs: torch's log settings
take any importable module name, and every module logs to ``logging.getLogger(__name__)``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from fsdp_traceable import fully_shard

    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    mesh = init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model(torch.randn(2, 8)).sum().backward()
    dist.destroy_process_group()
""")


def test_torch_logs_shows_group_formation_and_decisions(tmp_path: Path) -> None:
    env = dict(os.environ, TORCH_LOGS="+fsdp_traceable")
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parents[1]), *filter(None, [env.get("PYTHONPATH")])])
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "store")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    log = done.stderr
    for line in (
        # group formation: modules, parameters and sizes, mesh, reshard policy
        "fully_shard(Linear): group of 2 parameters (72 elements, torch.float32): "
        "weight (8, 8)->(8, 8), bias (8,)->(8,); mesh (1,) (FSDP); "
        "reshard_after_forward=default (True except the root)",
        # a block's own call links only itself, named by its class, not yet by its path
        "fully_shard(FSDPLinear) links 1 groups below it, itself the root until a "
        "fully_shard on a parent links them again",
        # the root, reshard decisions and prefetch order, once the root links the groups,
        # each group by its path under the root
        "group <FSDPSequential> (root): reshard_after_forward=False; forward prefetches ['0']",
        "group 0: reshard_after_forward=True; forward prefetches ['1']",
        "group 0 after forward: reshard (backward re-gathers)",
        "group <FSDPSequential> after forward: keep the unsharded parameters for backward",
        "prefetch: all-gather of group 1 issued early",
        "copy backend for all_gather_copy_in on cpu: inductor (copy_kernels='auto')",
    ):
        assert line in log, f"{line!r} not in the log:\n{log[-4000:]}"
