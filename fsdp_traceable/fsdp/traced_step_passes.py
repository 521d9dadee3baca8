"""The whole step's graph passes, put in place by any trace of a whole step that holds
``fully_shard``'s work, not by :func:`fsdp_traceable.compile_step` alone.

[Note: the whole step's passes in every whole step]
torch documents whole-step capture as ``torch._dynamo.config.trace_autograd_ops = True``
then ``torch.compile(train_step, fullgraph=True)``. Over ``fully_shard`` modules that
graph needs the package's completion of torch's forward-loss-backward recompute pass
(``_torch_patches.complete_whole_step_recompute``): without it, under Inductor, a
forward region's input that the region also returns for backward is overwritten before
the backward reads it (``docs/repros/invoke_subgraph_saved_input.py``), and the step's
numbers drift from FSDP2's (measured on 2.13: 1.6e-5 in the loss, 3.9e-4 in the local
shards after 4 SGD steps of a 3-block transformer, 2 ranks), and without forward
regions torch refuses the graph. So a module's forward, when Dynamo traces it with
``trace_autograd_ops`` on, installs the pass at trace time (a constant-result call,
which Dynamo runs while tracing, before AOTAutograd sees the graph); the pass acts on
graphs holding the package's ops only. The step then computes what ``compile_step``'s
computes (``compile_tests/test_whole_step.py``). The same call: records the compile as
one of the package's, the scope of the region schema memo
(``_torch_patches.memoize_region_schemas``); on torch 2.11, lets Dynamo trace
``backward()`` into DTensor parameters (``_torch_patches.trace_backward_into_subclasses``,
which ``backward()``, traced after the forward, looks up at its call: without it Dynamo
failed with a bare ``AssertionError``); and keys the compile's AOTAutograd and Inductor
caches by the passes, as ``compile_step`` keys them (see [Note: graph passes in the
cache key] in ``whole_step/graph_pass_key.py``).
"""

from __future__ import annotations

import torch

from .. import _torch_patches
from ..tracing import constant_result
from ..whole_step.graph_pass_key import key_this_compile_by_graph_passes


@constant_result
def _prepare_compile() -> bool:
    _torch_patches.mark_package_compile()
    _torch_patches.trace_backward_into_subclasses()
    key_this_compile_by_graph_passes()
    return _torch_patches.complete_whole_step_recompute()


def prepare_traced_step() -> None:
    """Called by every ``fully_shard`` forward: see [Note: the whole step's passes in
    every whole step]. Nothing outside a Dynamo trace of ``backward()``."""
    if torch.compiler.is_compiling() and getattr(torch._dynamo.config, "trace_autograd_ops", False):
        _prepare_compile()
