"""What one sharded model owns besides its parameter groups.

[Note: per-model state]
A process builds several models (train and eval copies, notebooks, test suites), so
nothing one model's forward or backward writes is process-global: it lives on the
model's :class:`RootState`, which every group of the model points to
(``ParamGroup.root_state``), and goes when the model goes. The root state is made by
the root's ``fully_shard`` call (the last one, applied bottom-up), for every group under
it; until then a group is its own model. Only eager code reads it (the compiled graphs
carry their state through autograd), so Dynamo never guards on it.

What stays process-wide is keyed by something process-wide and holds no model: FSDP
classes per module class (``fsdp_module``), the compiled-autograd hook and its outlined
backwards per compiled function, shared by every model that runs that compiled code
(``backward_regions``), the live groups' process-group names (``block_backward``,
weakly), and the parameters ``fully_shard`` replaced (``fully_shard``, weakly).
"""

from __future__ import annotations

from .finalization_state import BackwardFinalization
from .reduce_queue import ReduceQueue
from .saved_unsharded import SavedUnsharded


class RootState:
    """One model's eager state shared by its groups: the gradient reductions in flight,
    the unsharded parameters its forward saves as tokens, and who finalizes its backward
    (see [Note: backward finalization])."""

    def __init__(self) -> None:
        self.reduce_queue = ReduceQueue()
        self.saved_unsharded = SavedUnsharded()
        # How many forwards of the root module are running (a registered forward method
        # may call forward): a fully_shard([a, b]) group's pass needs one.
        self.root_forwards = 0
        self.finalization = BackwardFinalization(self.reduce_queue)
