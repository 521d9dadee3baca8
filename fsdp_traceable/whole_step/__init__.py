"""The whole training step as one graph, and the settings it compiles with.

* :mod:`.capture`: :func:`compile_step` (see [Note: whole-step capture]).
* :mod:`.traced_optimizer`: the optimizer update traced into the step.
* :mod:`.step_cache` and :mod:`.cpu_isa_probe`: the step compiled ahead of time,
  saved per rank and loaded by a restart.
* :mod:`.region_schedule`: the graph passes over a step whose blocks are region calls;
  :mod:`.copy_regions`: the bucket copies as region calls (see [Note: copy regions]).
* :mod:`.inductor_options`: Inductor settings for compiling a ``fully_shard``-ed model.
* :mod:`.graph_pass_key`: the graph passes in torch's compile cache keys, for
  :func:`compile_step` and a whole step compiled plainly.

Its modules sit on different layers (``tests/test_import_layers.py``):
``region_schedule``, ``cpu_isa_probe``, ``inductor_options`` and ``graph_pass_key`` with
the base modules, ``copy_regions`` with ``collectives``, the rest with ``fsdp``. So this
``__init__`` imports nothing on import: :func:`compile_step` and
:func:`dynamo_traces_backward_into_dtensors` are read from :mod:`.capture` on first use.
"""

from __future__ import annotations

from typing import Any

_FROM_CAPTURE = {"compile_step", "dynamo_traces_backward_into_dtensors"}


def __getattr__(name: str) -> Any:
    if name in _FROM_CAPTURE:
        from . import capture

        return getattr(capture, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["compile_step", "dynamo_traces_backward_into_dtensors"]
