"""What a group's modules register as their parameters (``module._parameters``) in
eager mode: the sharded ``nn.Parameter(DTensor)``s, or the unsharded tensors while the
group holds them, as FSDP2's ``FSDPParam.to_unsharded`` / ``to_sharded``.

[Note: registered parameters]
As FSDP2's, a group's modules register (``module._parameters``: ``parameters()``,
``named_parameters()``, the attribute outside forward) its unsharded parameters exactly
while the group is unsharded, in eager mode: from ``unshard()`` or the forward's
all-gather to the forward's end (``reshard_after_forward`` truthy) or to the backward's
end (falsy: the root's default); from the backward's re-gather to its end (or, with
``reshard_after_backward=False``, to the next forward's end); and until ``reshard()``.
Otherwise the sharded ``nn.Parameter(DTensor)``s, which the optimizer holds. With
``reshard_after_forward=N`` the sharded DTensors are registered after forward (FSDP2
registers a DTensor over N ranks: the same global shape and values). The registered
unsharded tensor is the one the attribute reads: during forward the group's all-gather
output (not a leaf: its gradient flows to the sharded parameter), outside forward a
detached alias of it. It is no ``nn.Parameter`` and never has a ``.grad`` (FSDP2's is a
leaf whose ``.grad`` holds the unsharded gradient until the reduce-scatter): gradients
reach the sharded parameters' ``.grad`` only. :meth:`ParamRegistration.update` writes
``_parameters`` directly, past the swapped-in ``register_parameter`` (a user's
replacement); the swapped-in state-dict methods reshard first, as FSDP2's state-dict
pre-hooks do. Registration is an eager step: a traced call registers nothing, so no
graph changes. A traced forward after an eager step that left unsharded tensors
registered (``unshard()``, a forward that keeps them) reads the group's own sharded
parameters (``autograd_bridge._module_params``) and, at its end, registers them again
(:meth:`ParamRegistration.register_sharded`: a side effect Dynamo replays after the
graph, traced only then); so does a backward compiled autograd traces after an eager
forward that kept them (``ParamGroup.post_backward``).
"""

from __future__ import annotations

import torch

from ..tracing import is_tracing
from .eager_state import EagerState
from .param_shards import ParamShards
from .unsharded_binding import register_bound, register_tensors


class ParamRegistration:
    """Which tensors one group's modules register (see [Note: registered parameters]).

    Args:
        params: the group's parameters and their bindings to the modules.
        eager_state: the group's eager state (the unsharded parameters it holds
            between calls).
    """

    def __init__(self, params: ParamShards, eager_state: EagerState) -> None:
        self._params = params
        self._eager_state = eager_state
        # Whether the modules register unsharded tensors now.
        self.unsharded = False

    def forget(self) -> None:
        """The modules register the sharded parameters already (``module._apply``
        resharded them first)."""
        self.unsharded = False

    def register_sharded(self) -> None:
        """Registers the sharded parameters again where unsharded ones are registered.
        Also a traced step's end after an eager ``unshard()`` (or a forward that kept
        them): a side effect Dynamo replays after the graph, traced only where the flag
        was set when it traced."""
        if self.unsharded:
            register_tensors(self._params.bindings, self._params.sharded_params)
            self.unsharded = False

    def update(self) -> None:
        """Eager: registers on the modules the unsharded parameters while the group
        holds them, else the sharded ones."""
        if torch.compiler.is_compiling():  # a constant to Dynamo: nothing traced here
            return
        params = self._params
        bound = params.is_bound
        held = None if bound else self._eager_state.held_unsharded
        if not bound and held is None and not self.unsharded:
            return  # sharded, and the sharded parameters registered: the common case
        if is_tracing():  # a proxy mode: compiled autograd's capture
            # Not use_traced_path(): with collectives_path="traced" a call outside any
            # trace runs this Python for real, so registering is right (and reading the
            # config is most of this step's cost).
            return
        if bound:
            register_bound(params.bindings)
        elif held is not None:
            if params.has_tp_params:
                held = [params.bound_value(i, t) for i, t in enumerate(held)]
            register_tensors(params.bindings, held)
        else:
            self.register_sharded()
            return
        self.unsharded = True
