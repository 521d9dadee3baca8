"""``module.compile()`` on a ``fully_shard``-ed module: which modules split (compute
compiled, collectives eager) and how a compile made before ``fully_shard`` is read back.
The compiled runs themselves: ``compile_tests/test_block_compile.py``."""

from __future__ import annotations

import torch
import torch.nn as nn

from fsdp_traceable.fsdp.features import module_compile


def test_the_compile_settings_are_read_back_from_torchs_compiled_call() -> None:
    module = nn.Linear(2, 2)
    module.compile(backend="aot_eager", fullgraph=True)  # lazy: nothing compiles here
    recompile = module_compile._same_compile(module._compiled_call_impl)
    assert isinstance(recompile, torch._dynamo.eval_frame._TorchDynamoContext)
    rewrapped = recompile(lambda x: x + 1)
    assert rewrapped._torchdynamo_orig_callable is not None


def test_a_call_without_a_dynamo_context_is_not_read() -> None:
    def plain(x: torch.Tensor) -> torch.Tensor:
        return x

    captured = 1

    def closure(x: torch.Tensor) -> torch.Tensor:
        return x * captured

    assert module_compile._same_compile(plain) is None
    assert module_compile._same_compile(closure) is None
    module = nn.Linear(2, 2)
    module.__dict__["_compiled_call_impl"] = closure
    assert module_compile.adopt_compiled_call(module, closure, lambda m: False) is None
    assert module._compiled_call_impl is closure  # left as it was
