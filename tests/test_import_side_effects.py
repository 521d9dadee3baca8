"""``import fsdp_traceable`` changes nothing of torch, imports no compiler, and leaves a
user's own torch warnings alone.

Each check runs in a fresh interpreter (``python -c``, started outside the repository
so the ``fsdp_traceable`` under test is the one installed or on ``PYTHONPATH``): what
torch looks like before and after the import, compared. The patches of
``fsdp_traceable._torch_patches`` are applied by the package's own entry points
(``fully_shard``, ``compile_step``, a saved step's load; see [Note: torch patches]).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from fsdp_traceable import _torch_patches


def _run(code: str, cwd: Path, as_module: bool = False) -> str:
    """Runs ``code`` in a fresh interpreter (``python -c``, or ``python -m`` of a module
    holding it) and returns its last line of output."""
    argv = ["-c", textwrap.dedent(code)]
    if as_module:
        (cwd / "user_program.py").write_text(textwrap.dedent(code))
        argv = ["-m", "user_program"]
    result = subprocess.run([sys.executable, *argv], cwd=cwd,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout.strip().splitlines()[-1]


# What the subprocess snapshots: every place a patch of the package writes to, and the
# process-wide registries a library could add to (Dynamo's frame strategies and
# compile callbacks, trace rules, the configs, torch's loggers, the dispatcher).
_SNAPSHOT = """
import copy, importlib, json, logging, sys
import torch
import torch._dynamo, torch._dynamo.eval_frame, torch._dynamo.trace_rules
import torch._dynamo.callback
import torch._inductor.config, torch._functorch.config
from torch.distributed.tensor import DTensor

PATCHED = [  # (module, class or None, attribute): what _torch_patches replaces
    ("torch._functorch.autograd_function", "DynamoAutogradFunctionTraceHelper", "fwd_trace_helper"),
    ("torch._higher_order_ops.wrap", None, "warning_once"),
    ("torch._higher_order_ops.invoke_subgraph", "InvokeSubgraphHOP", "gen_schema"),
    ("torch._dynamo.variables.invoke_subgraph", None, "stamp_out_subgraph"),
    ("torch._dynamo.compiled_autograd", None, "extract_bw_module"),
    ("torch._dynamo.variables.torch", None, "_collect_tensors_with_sources"),
    ("torch.distributed.device_mesh", "DeviceMesh", "__getstate__"),
    ("torch._inductor.cpu_vec_isa", "VecISA", "_probe_load"),
    ("torch._inductor.codecache", None, "_precompile_header"),
    ("%(remat)s", None, "remat_using_tags_for_fwd_loss_bwd_graph"),
]

def patched():
    found = {}
    for module_name, class_name, name in PATCHED:
        try:
            owner = importlib.import_module(module_name)
        except ImportError:
            continue
        if class_name is not None:
            owner = getattr(owner, class_name)
        found[f"{module_name}.{class_name}.{name}"] = vars(owner).get(name)
    op = torch.ops.aten.new_empty_strided.default
    found["new_empty_strided strategy"] = (
        DTensor._op_dispatcher.sharding_propagator.op_strategy_funcs.get(op))
    return found

# Every frame strategy Dynamo is told to take (skip_code and friends).
strategies = []
_set_strategy = torch._dynamo.eval_frame.set_code_exec_strategy
def record_strategy(code, strategy):
    strategies.append(code.co_qualname)
    return _set_strategy(code, strategy)
torch._dynamo.eval_frame.set_code_exec_strategy = record_strategy

def containers(module):
    return {name: copy.copy(value) for name, value in vars(module).items()
            if isinstance(value, (set, frozenset, dict, list, tuple))
            and not name.startswith("__")}

def loggers():
    manager = logging.Logger.manager
    names = [name for name in manager.loggerDict if name == "torch" or name.startswith("torch.")]
    states = {}
    for name in ["", *names]:
        logger = logging.getLogger(name)
        if isinstance(logger, logging.Logger):
            states[name] = (logger.level, logger.propagate, logger.disabled,
                            tuple(logger.filters), tuple(logger.handlers))
    return states

def snapshot():
    handler = torch._dynamo.callback.callback_handler
    return {
        "patched": patched(),
        "trace_rules": containers(torch._dynamo.trace_rules),
        "dynamo config": torch._dynamo.config.get_config_copy(),
        "inductor config": torch._inductor.config.get_config_copy(),
        "functorch config": torch._functorch.config.get_config_copy(),
        "compile callbacks": (tuple(handler.start_callbacks), tuple(handler.end_callbacks)),
        "loggers": loggers(),
        "log registry": containers(torch._logging._internal.log_registry),
        "ops": {name for name in torch._C._dispatch_get_all_op_names()
                if not name.startswith("fsdp_traceable::")},
        "frame strategies": list(strategies),
    }

before = snapshot()
import fsdp_traceable
after = snapshot()
changed = {kind: sorted(repr(key) for key in set(before[kind]) | set(after[kind])
                        if before[kind].get(key) != after[kind].get(key))
                 if isinstance(before[kind], dict) else before[kind] != after[kind]
           for kind in before}
print(json.dumps({kind: diff for kind, diff in changed.items() if diff}))
"""


def test_import_changes_nothing_of_torch(tmp_path: Path) -> None:
    changed = json.loads(_run(_SNAPSHOT % {"remat": _torch_patches.REMAT_PASS_MODULE}, tmp_path))
    assert changed == {}


def test_import_loads_no_compiler_and_registers_the_ops(tmp_path: Path) -> None:
    # A user's program run with python -m: only python -m fsdp_traceable defers the
    # ops (see [Note: the package import and the command line]).
    out = _run("""
        import json, sys
        import torch.distributed.fsdp
        heavy = ("torch._dynamo", "torch._inductor", "triton")
        before = [name for name in heavy if name in sys.modules]
        import fsdp_traceable
        import torch
        ops = [hasattr(torch.ops.fsdp_traceable, name) for name in (
            "all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in",
            "reduce_scatter_view_out")]
        print(json.dumps([before, [name for name in heavy if name in sys.modules], ops]))
    """, tmp_path, as_module=True)
    before, after, ops = json.loads(out)
    assert before == [] and after == []
    assert all(ops)


_NEIGHBOURS = Path(__file__).with_name("neighbour_workloads.py")


def _neighbours(which: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(_NEIGHBOURS), which], cwd=cwd, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                    reason="needs a torch that compiles selective checkpoints (2.11+)")
def test_users_own_workloads_run_as_in_a_process_that_never_imported_us(
        tmp_path: Path) -> None:
    # Both processes at once: one trains a model of ours first, the other never imports us.
    procs = {which: _neighbours(which, tmp_path) for which in ("ours", "alone")}
    outputs = {}
    for which, proc in procs.items():
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"{which}:\n{err[-4000:]}"
        outputs[which] = json.loads(out.strip().splitlines()[-1])
    ours, alone = outputs["ours"], outputs["alone"]
    # Our recompute region reached torch's context_fn warning, which the patch kept quiet ...
    assert ours.pop("ours") == {"regions_seen": ["_recompute_all_gather_context"],
                                "warnings": []}
    assert ours.pop("imported_ours") is True and alone.pop("imported_ours") is False
    # ... and the user's own workloads afterwards give the same numbers (bit for bit), the
    # same graphs, and the same warnings (their selective checkpoint's included).
    assert len(alone["warnings"]) == 1 and _torch_patches.CONTEXT_FN_WARNING in alone["warnings"][0]
    for name in alone:
        assert ours[name] == alone[name], name


def test_constant_result_marks_as_dynamo_does() -> None:
    from fsdp_traceable.tracing import constant_result

    def ours() -> int:
        return 1

    def dynamos() -> int:
        return 1

    torch._dynamo.assume_constant_result(dynamos)
    constant_result(ours)
    assert vars(ours) == vars(dynamos) != {}


def test_every_public_name_is_its_modules_object() -> None:
    # Read on first use from the module it lives in (the package __init__'s __getattr__).
    import fsdp_traceable
    from fsdp_traceable import collectives, fsdp
    from fsdp_traceable.whole_step import capture

    assert set(fsdp_traceable.__all__) <= set(dir(fsdp_traceable))
    for name in fsdp_traceable.__all__:
        assert getattr(fsdp_traceable, name) is not None, name
    assert fsdp_traceable.fully_shard is fsdp.fully_shard
    assert fsdp_traceable.compile_step is capture.compile_step
    assert fsdp_traceable.shard_tensor is collectives.shard_tensor
    with pytest.raises(AttributeError, match="no attribute 'fullyshard'"):
        fsdp_traceable.fullyshard  # noqa: B018
