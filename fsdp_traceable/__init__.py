"""fsdp_traceable: FSDP2's bucketed collectives as functional, traceable ops, and a
drop-in ``fully_shard`` on top.

Layers, lowest first, each importing only its own and the ones below it
(``tests/test_import_layers.py``):

* :mod:`.config`, :mod:`.sizes`, :mod:`.tracing`, :mod:`.fx_ops`: switches and shared
  arithmetic; :mod:`._torch_patches`: every patch of torch; :mod:`.profiler_labels`.
* :mod:`.collectives`: the ``torch.ops.fsdp_traceable`` copy ops and the foreach
  all-gather / reduce on plain tensors (traced and eager paths).
* :mod:`.backward_regions`: compiled autograd's backward of a repeated block as one region.
* :mod:`.fsdp`: ``fully_shard`` and ``FSDPModule``; :mod:`.whole_step`: ``compile_step``
  and the settings a step compiles with (its modules on the layers above, see its docstring).
* :mod:`.models`: the built-in transformer.
* :mod:`.introspection`, then :mod:`.testing`: reading compiled graphs, pinning graph breaks
  and recompiles, process-group set-ups for tests (imported on demand).
* :mod:`.cli`: the ``python -m fsdp_traceable`` commands (imported on demand).

Importing the package registers the ``torch.ops.fsdp_traceable`` ops; its public names
are read from their modules on first use, and ``python -m fsdp_traceable`` imports no
torch before a command needs it (see [Note: the package import and the command line]).

Debug logs: ``TORCH_LOGS="+fsdp_traceable"``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from . import _source_tree  # noqa: F401  (see its docstring)
from ._command_line import running_the_command_line

# Public name -> the module it is read from on first use; see
# [Note: the package import and the command line].
_PUBLIC = {
    "AllGatherResult": ".collectives",
    "ReduceResult": ".collectives",
    "ReduceSchedule": ".collectives",
    "ShardInfo": ".collectives",
    "foreach_all_gather": ".collectives",
    "foreach_all_gather_copy_out": ".collectives",
    "foreach_reduce": ".collectives",
    "gradient_divide_schedule": ".collectives",
    "make_shard_info": ".collectives",
    "shard_tensor": ".collectives",
    "FSDPModule": ".fsdp",
    "fully_shard": ".fsdp",
    "compile_step": ".whole_step.capture",
    "inductor_options": ".whole_step.inductor_options",
    "MixedPrecisionPolicy": "torch.distributed.fsdp",
}

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from . import config
    from .collectives import (
        AllGatherResult,
        ReduceResult,
        ReduceSchedule,
        ShardInfo,
        foreach_all_gather,
        foreach_all_gather_copy_out,
        foreach_reduce,
        gradient_divide_schedule,
        make_shard_info,
        shard_tensor,
    )
    from .fsdp import FSDPModule, fully_shard
    from .whole_step.capture import compile_step
    from .whole_step.inductor_options import inductor_options


def __getattr__(name: str) -> Any:
    if name == "config":
        return importlib.import_module(f"{__name__}.config")
    source = _PUBLIC.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(source, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


if not running_the_command_line():
    from . import (
        collectives,  # noqa: F401  (registers torch.ops.fsdp_traceable)
        config,  # noqa: F401
    )

__all__ = [
    "AllGatherResult",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ReduceResult",
    "ReduceSchedule",
    "ShardInfo",
    "compile_step",
    "config",
    "foreach_all_gather",
    "foreach_all_gather_copy_out",
    "foreach_reduce",
    "fully_shard",
    "gradient_divide_schedule",
    "inductor_options",
    "make_shard_info",
    "shard_tensor",
]
