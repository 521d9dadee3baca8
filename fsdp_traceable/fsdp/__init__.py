"""The module API: :func:`fully_shard` and :class:`FSDPModule`, FSDP2's interface on
top of :mod:`fsdp_traceable.collectives`.

Each ``fully_shard`` call makes one :class:`~.param_group.ParamGroup`; its
all-gather and reduce-scatter (:mod:`.gradient_reduction`) meet autograd in one
``autograd.Function`` (:mod:`.autograd_bridge`); eager reshard-after-forward saves
tokens instead of unsharded parameters (:mod:`.saved_unsharded`).
"""

from .fsdp_module import FSDPModule
from .fully_shard import fully_shard

__all__ = ["FSDPModule", "fully_shard"]
