"""A restarted process finds the graphs the last one compiled in AOTAutograd's and
Inductor's FX graph caches: a fully_shard model's graphs take each DTensor parameter's
mesh as an input, and their cache keys must not change between processes; a whole step
(``compile_step``) holds ``fully_shard``'s ``autograd.Function``, which AOTAutograd's
cache bypasses unless allowed."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

_ROOT = pathlib.Path(__file__).resolve().parent.parent

# The whole step of a two-layer fully_shard model (one graph, compiled by Inductor;
# torch 2.11, where compile_step raises, compiles the forward for inference), one process
# on the fake group; prints the two caches' counters.
_COMPILE_STEP = textwrap.dedent("""
    import json
    import torch
    from torch._dynamo.utils import counters
    import fsdp_traceable
    from fsdp_traceable.introspection.fake_world import fake_process_group
    from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors

    with fake_process_group(2):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        fsdp_traceable.fully_shard(model[0])
        fsdp_traceable.fully_shard(model)
        if dynamo_traces_backward_into_dtensors():
            def step(x):
                loss = model(x).sum()
                loss.backward()
                return loss.detach()

            fsdp_traceable.compile_step(step)(torch.randn(3, 8))
        else:
            with torch.no_grad():
                torch.compile(model, fullgraph=True)(torch.randn(3, 8))
        print("RESULT " + json.dumps({k: v for k, v in [*counters["inductor"].items(),
                                                        *counters["aot_autograd"].items()]
                                      if k.startswith(("fxgraph_cache", "autograd_cache"))}))
""")


def _run_in_new_process(cache_dir: pathlib.Path) -> dict[str, int]:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir),
               PYTHONPATH=os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TORCHINDUCTOR_FORCE_DISABLE_CACHES", None)
    proc = subprocess.run([sys.executable, "-c", _COMPILE_STEP], env=env, capture_output=True,
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
    if dynamo_traces_backward_into_dtensors():  # the whole step, through AOTAutograd's cache
        assert first.get("autograd_cache_miss", 0) == 1, first
        assert restarted.get("autograd_cache_hit", 0) == 1, restarted
