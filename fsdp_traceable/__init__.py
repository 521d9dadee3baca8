"""fsdp_traceable: FSDP2's bucketed collectives as functional, traceable ops, and a
drop-in ``fully_shard`` on top.

Layers, lowest first, each importing only its own and the ones below it
(``tests/test_import_layers.py``):

* :mod:`.config`, :mod:`.sizes`, :mod:`.tracing`, :mod:`.fx_ops`: switches and shared
  arithmetic; :mod:`._torch_patches`: every patch of torch; :mod:`.profiler_labels`.
* :mod:`.collectives`: the ``torch.ops.fsdp_traceable`` copy ops and the foreach
  all-gather / reduce on plain tensors (traced and eager paths).
* :mod:`.backward_regions`: compiled autograd's backward of a repeated block as one region.
* :mod:`.fsdp`: ``fully_shard`` and ``FSDPModule``; :mod:`.whole_step`: ``compile_step``.
* :mod:`.models`: the built-in transformer.
* :mod:`.inspect`, then :mod:`.testing`: reading compiled graphs, pinning graph breaks
  and recompiles, process-group set-ups for tests (imported on demand).
* :mod:`.cli`: the ``python -m fsdp_traceable`` commands (imported on demand).

Debug logs: ``TORCH_LOGS="+fsdp_traceable"``.
"""

from torch.distributed.fsdp import MixedPrecisionPolicy

from . import _source_tree, config  # noqa: F401  (_source_tree: see its docstring)
from .collectives import (
    AllGatherResult,
    ReduceResult,
    ReduceSchedule,
    ShardInfo,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
    gradient_divide_schedule,
    inductor_options,
    make_shard_info,
    shard_tensor,
)
from .fsdp import FSDPModule, fully_shard
from .whole_step import compile_step

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
