"""``FSDPModule``'s reduction and prefetch setters under ``torch.compile``: the ones a
compiled graph can apply are traced into it (a change recompiles once, with the reason
in the recompile log); the ones it cannot raise clearly. Single process on the fake
process group, ``aot_eager`` backends; numbers against FSDP2 are in
``tests/fsdp/test_module_settings_parity.py``."""

from __future__ import annotations

import pytest
from torch.distributed.device_mesh import init_device_mesh

from compile_tests.sharded_model import make_model
from compile_tests.test_recompiles import Step
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.testing import track_compiles


def _modules(model):
    return [model, *model.layers]


@pytest.mark.parametrize("compiled_autograd", [False, True], ids=["aot-backward", "ca"])
def test_changing_the_divide_factor_recompiles_once(fake_world: None, compiled_autograd) -> None:
    step = Step(make_model(), compiled_autograd=compiled_autograd)
    step.microbatch()
    with track_compiles() as record:
        for module in _modules(step.model):
            module.set_gradient_divide_factor(8.0)
        for _ in range(3):
            step.microbatch()
    # The forward frame recompiles once (its guards include the factor, which the
    # backward traced with it reads); under compiled autograd the backward is also
    # captured once more, with the new factor.
    reasons = [r.recompile_reason for r in record.recompiles]
    assert len(reasons) == 1 and "gradient_divide_factor" in reasons[0]
    assert record.compiled_autograd_captures == (1 if compiled_autograd else 0)


@pytest.mark.parametrize("setter", ["forward", "backward"])
def test_explicit_prefetch_raises_under_compile(fake_world: None, setter: str) -> None:
    """Either list raises at the first forward; cleared, the model compiles (checked once)."""
    step = Step(make_model(), compiled_autograd=True)
    blocks = list(step.model.layers)
    getattr(blocks[0], f"set_modules_to_{setter}_prefetch")(blocks[1:])
    with pytest.raises(Exception, match=r"set_modules_to_forward_prefetch / "
                                        r"set_modules_to_backward_prefetch schedule eager"):
        step.microbatch()
    if setter == "forward":
        blocks[0].set_modules_to_forward_prefetch([])
        step.microbatch()  # cleared: compiles


def test_skipping_the_hsdp_all_reduce_raises_under_compiled_autograd() -> None:
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        step = Step(make_model(mesh=mesh), compiled_autograd=True)
        step.model.set_requires_all_reduce(False)
        with pytest.raises(Exception, match=r"set_requires_all_reduce\(False\) keeps the "
                                            r"reduce-scattered gradients"):
            step.microbatch()


def test_all_reduce_hook_is_traced_into_the_backward(fake_world: None) -> None:
    step = Step(make_model(), compiled_autograd=True)
    step.model.set_all_reduce_hook(lambda reduce_output: reduce_output.mul_(0.25))
    step.microbatch()
    graph = step.backward.graphs[-1]
    muls = [n for n in graph.graph.nodes
            if n.op == "call_function" and 0.25 in n.args and "mul" in str(n.target)]
    assert len(muls) == 1


@pytest.mark.parametrize("which", ["all_gather", "reduce_scatter"])
def test_custom_comms_raise_under_compile(fake_world: None, which: str) -> None:
    from tests.fsdp.settings_cases import CountingAllGather, CountingReduceScatter

    step = Step(make_model(), compiled_autograd=True)
    comm = CountingAllGather() if which == "all_gather" else CountingReduceScatter()
    for module in _modules(step.model):
        getattr(module, f"set_custom_{which}")(comm)
    with pytest.raises(Exception, match=rf"a custom {which.replace('_', '-')} "
                                        rf"\(set_custom_{which}\) runs eagerly only"):
        step.microbatch()
