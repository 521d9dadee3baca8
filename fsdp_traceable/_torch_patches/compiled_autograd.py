"""Compiled autograd reads every AOT backward graph through a rewrite."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx


def extract_bw_module_exists() -> bool:
    """Whether compiled autograd reads AOT backwards through ``extract_bw_module``."""
    module = getattr(torch._dynamo, "compiled_autograd", None)
    return module is not None and hasattr(module, "extract_bw_module")


def rewrite_aot_backwards(
    rewrite: Callable[[Any, fx.GraphModule], fx.GraphModule],
) -> bool:
    """Compiled autograd reads every AOT backward graph through ``rewrite``.

    Compiled autograd pastes every AOTAutograd backward it meets into its graph node
    by node, so L identical per-block compiled blocks give L copies of the block
    backward to trace and compile again. Torch cannot keep them as one: compiled
    autograd cannot trace a ``nested_compile_region`` (Dynamo refuses the
    ``invoke_subgraph`` it pastes), and it has no public hook. The one function it
    reads every AOT backward through,
    ``torch._dynamo.compiled_autograd.extract_bw_module(compiled_function)``, is
    wrapped so ``rewrite(compiled_function, bw_module)`` can return another graph
    (``backward_regions`` returns the block backward as one region call). The wrapper
    runs with Dynamo disabled: compiled autograd can capture while Dynamo's frame hook
    is set (torch 2.11 and 2.14 after a graph break at ``backward()``).

    Applies to: every torch with ``compiled_autograd.extract_bw_module`` (2.11 to 2.14).

    Args:
        rewrite: called with the compiled function (a class) and its backward graph;
            returns the graph compiled autograd pastes. Applying again with the same
            ``rewrite`` changes nothing.

    Returns:
        Whether compiled autograd now reads backwards through ``rewrite`` (``False``
        where torch has no ``extract_bw_module``).

    Raises:
        RuntimeError: if another ``rewrite`` is in place already.
    """
    if not extract_bw_module_exists():
        return False
    module = torch._dynamo.compiled_autograd
    current = module.extract_bw_module
    installed = getattr(current, "_fsdp_traceable_rewrite", None)
    if installed is rewrite:
        return True
    if installed is not None:
        raise RuntimeError(
            f"compiled autograd's extract_bw_module already rewrites with {installed!r}; "
            "one rewrite serves the whole process"
        )

    @torch.compiler.disable
    def extract_bw_module(compiled_function: Any) -> Any:
        bw_module = current(compiled_function)
        if not isinstance(bw_module, fx.GraphModule):
            return bw_module
        return rewrite(compiled_function, bw_module)

    extract_bw_module._fsdp_traceable_rewrite = rewrite
    module.extract_bw_module = extract_bw_module
    return True
