"""A restarted process finds the graphs the last one compiled in Inductor's FX graph
cache: a fully_shard model's graphs take each DTensor parameter's mesh as an input, and
their cache keys must not change between processes."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# The forward of a two-layer fully_shard model (inference: one graph, compiled by
# Inductor), one process on the fake group; prints Inductor's FX graph cache counters.
_COMPILE_INFERENCE = textwrap.dedent("""
    import json
    import torch
    from torch._dynamo.utils import counters
    import fsdp_traceable
    from fsdp_traceable.testing.fake_world import fake_process_group

    with fake_process_group(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fsdp_traceable.fully_shard(model[0])
        fsdp_traceable.fully_shard(model)
        compiled = torch.compile(model, fullgraph=True)
        with torch.no_grad():
            compiled(torch.randn(3, 8))
        print("RESULT " + json.dumps({k: v for k, v in counters["inductor"].items()
                                      if k.startswith("fxgraph_cache")}))
""")


def _run_in_new_process(cache_dir: pathlib.Path) -> dict[str, int]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_INFERENCE], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def test_restarted_process_hits_every_graph_the_first_compiled(tmp_path):
    first = _run_in_new_process(tmp_path)
    assert first.get("fxgraph_cache_miss", 0) == 1, first
    restarted = _run_in_new_process(tmp_path)
    assert restarted.get("fxgraph_cache_miss", 0) == 0, restarted
    assert restarted.get("fxgraph_cache_hit", 0) == 1, restarted
