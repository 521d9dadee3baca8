"""The traceable core: FSDP2's bucketed collectives on plain tensors.

:func:`foreach_all_gather`, :func:`foreach_all_gather_copy_out` and
:func:`foreach_reduce` run as functional collectives while tracing and as async c10d
in eager, with the copies of ``torch.ops.fsdp_traceable`` (:mod:`.ops`) or the
backend ``config.copy_kernels`` picks (:mod:`.copy_backends`); every path computes
the same bits.
"""

from ..whole_step.inductor_options import inductor_options
from . import ops  # noqa: F401  (registers torch.ops.fsdp_traceable)
from .all_gather import AllGatherResult, foreach_all_gather, foreach_all_gather_copy_out
from .divide_factors import ReduceSchedule, gradient_divide_schedule
from .reduce import ReduceResult, accumulate_sharded_grad, foreach_reduce
from .shard_info import ShardInfo, make_shard_info, shard_tensor

__all__ = [
    "AllGatherResult",
    "ReduceResult",
    "ReduceSchedule",
    "ShardInfo",
    "accumulate_sharded_grad",
    "foreach_all_gather",
    "foreach_all_gather_copy_out",
    "foreach_reduce",
    "gradient_divide_schedule",
    "inductor_options",
    "make_shard_info",
    "shard_tensor",
]
