"""``module.compile()`` on a ``fully_shard``-ed module: its compute compiled, its
group's collectives eager around it.

[Note: per-module compile]
FSDP2's per-block compile (``block.compile()``, torchtitan's recipe) compiles the
block's ``_call_impl``, whose FSDP hooks Dynamo skips: the all-gather, the prefetch of
the next block and the reduce-scatter run eagerly (async, overlapping compute) and the
graph holds the block's compute. Tracing the collectives into a block's own graph
instead buys nothing: a graph cannot start the next block's all-gather, so each
block would wait for its own all-gather, and its reduce-scatter, inside its graph.

Ours does what FSDP2 does, without a graph break: ``FSDPModule.compile`` compiles
``FSDPModule._fsdp_compute``, the forward (and the forward hooks FSDP2 runs while the
parameters are unsharded) over the bound unsharded parameters, and
``FSDPModule.forward`` calls it between the group's eager ``pre_forward`` and
``post_forward``. So:

- prefetching, ``set_requires_gradient_sync(False)`` and every eager knob work as in
  eager mode;
- with reshard-after-forward, what the compiled forward saves for backward goes
  through the group's saved-tensor hooks (:mod:`..saved_unsharded`) like eager's
  saves: a token, re-gathered in backward; under compiled autograd that re-gather is
  traced (``ParamGroup.pre_backward``);
- inside a larger compiled graph (whole-model compile, ``compile_step``) the module
  is traced as if not compiled: its collectives are traced with the rest.

A module compiled before ``fully_shard`` (torchtitan compiles, then shards) is
converted when ``fully_shard`` swaps its class: :func:`adopt_compiled_call` re-wraps
the module's compute with the same ``torch.compile`` settings, read from the compiled
call torch left. Where they cannot be read (another torch), the compiled call stays
and traces the collectives into the block's graph, as before.

Only a module with no ``fully_shard``-ed module below it splits so. One with some (the
root, ``model.compile()``) is compiled as torch compiles it: its graph takes in the
modules below, whose collectives it must trace anyway, and its own with them, so
Inductor can overlap them all (whole-model compile).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn


def compiles_compute_alone(module: nn.Module, is_sharded: Callable[[nn.Module], bool]) -> bool:
    """Whether ``module.compile()`` compiles ``module``'s compute alone: no module
    below it is ``fully_shard``-ed (``is_sharded``; see [Note: per-module compile])."""
    return not any(is_sharded(m) for m in module.modules() if m is not module)


def adopt_compiled_call(module: nn.Module, compute: Callable[..., Any],
                        is_sharded: Callable[[nn.Module], bool]) -> Callable[..., Any] | None:
    """If ``module`` was compiled by torch's ``Module.compile()``, its ``compute``
    compiled alone with the same settings instead (torch's compiled call is dropped);
    else ``None``, and the module is left as it was.

    Args:
        module: the module ``fully_shard`` just made an ``FSDPModule``.
        compute: its ``FSDPModule._fsdp_compute``.
        is_sharded: whether a module is ``fully_shard``-ed.
    """
    compiled_call = module.__dict__.get("_compiled_call_impl")
    if compiled_call is None or not compiles_compute_alone(module, is_sharded):
        return None
    recompile = _same_compile(compiled_call)
    if recompile is None:
        return None
    module._compiled_call_impl = None
    return recompile(compute)


def _same_compile(compiled: Callable[..., Any]) -> Callable[[Callable], Callable] | None:
    """What wraps a function with the ``torch.compile`` settings ``compiled`` was made
    with: the Dynamo context its wrapper closes over (torch 2.11 to 2.14), or None."""
    context_class = getattr(torch._dynamo.eval_frame, "_TorchDynamoContext", None)
    code = getattr(compiled, "__code__", None)
    if context_class is None or code is None or compiled.__closure__ is None:
        return None
    for name, cell in zip(code.co_freevars, compiled.__closure__):
        if name == "self" and isinstance(cell.cell_contents, context_class):
            return cell.cell_contents
    return None
