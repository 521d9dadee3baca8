"""fsdp_traceable: FSDP2's bucketed collectives as functional, traceable ops."""

from . import config, ops  # noqa: F401  (registers torch.ops.fsdp_traceable)
from .collectives import (
    AllGatherResult,
    ReduceResult,
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
)
from .divide_factors import ReduceSchedule, gradient_divide_schedule
from .inductor_options import inductor_options
from .shard_info import ShardInfo, make_shard_info, shard_tensor

__all__ = [
    "AllGatherResult",
    "ReduceResult",
    "ReduceSchedule",
    "ShardInfo",
    "foreach_all_gather",
    "foreach_all_gather_copy_out",
    "foreach_reduce",
    "gradient_divide_schedule",
    "inductor_options",
    "make_shard_info",
    "shard_tensor",
]

from torch.distributed.fsdp import MixedPrecisionPolicy  # noqa: E402

from .fully_shard import FSDPModule, fully_shard  # noqa: E402

__all__ += ["FSDPModule", "MixedPrecisionPolicy", "fully_shard"]
