"""fsdp_traceable: FSDP2's bucketed collectives as functional, traceable ops, and a
drop-in ``fully_shard`` on top.

Layers, each importing only the ones below it:

* :mod:`.config`, :mod:`.sizes`, :mod:`.tracing`: switches and shared arithmetic.
* :mod:`.collectives`: the ``torch.ops.fsdp_traceable`` copy ops and the foreach
  all-gather / reduce on plain tensors (traced and eager paths).
* :mod:`.fsdp`: ``fully_shard`` and ``FSDPModule``.
* :mod:`.inspect` and :mod:`.testing`: reading compiled graphs, pinning graph breaks
  and recompiles, process-group set-ups for tests (imported on demand).
* :mod:`.cli`: the ``python -m fsdp_traceable`` commands (imported on demand).
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

__all__ = [
    "AllGatherResult",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "ReduceResult",
    "ReduceSchedule",
    "ShardInfo",
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
