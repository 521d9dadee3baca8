"""A parameter group's settings: FSDP2's per-group knobs.

[Note: group settings]
A group's settings are plain public attributes of its :class:`GroupSettings`, read on
every step (so a compiled graph guards on them and recompiles once when one changes).
They are set at ``fully_shard`` time and afterwards only through
:meth:`GroupSettings.configure`, which ``FSDPModule``'s setters (through
``ParamGroup.configure``) and the root's linking of the groups call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch.distributed.device_mesh import DeviceMesh

from ..collectives import comm
from .features.post_forward_mesh import PostForwardMesh

if TYPE_CHECKING:  # FSDP2's comm interfaces, for annotations only
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

# The settings :meth:`GroupSettings.configure` may change.
SETTINGS = frozenset({
    "reshard_after_forward", "reshard_after_backward", "requires_gradient_sync",
    "requires_all_reduce", "gradient_divide_factor", "force_sum_reduction",
    "reduce_scatter_unused_params", "all_reduce_hook", "all_reduce_hook_stream",
    "unshard_in_backward", "all_gather_comm", "reduce_scatter_comm",
    "explicit_forward_prefetch", "explicit_backward_prefetch", "prefetch_backward",
    "streams", "is_root", "keep_unsharded_storage", "unshard_async_op",
    "inside_checkpoint_wrapper",
})


class GroupSettings:
    """What one group does, as FSDP2's ``fully_shard`` arguments and ``FSDPModule``
    setters say; see [Note: group settings].

    Args:
        mesh: the group's data-parallel mesh (for ``reshard_after_forward=N``).
        reshard_after_forward: ``fully_shard``'s argument.
    """

    def __init__(self, mesh: DeviceMesh, *, reshard_after_forward: bool | int | None) -> None:
        self._mesh = mesh
        # The root group (set when the root links the groups) reshards after forward
        # only when told to.
        self.is_root = False
        # None: FSDP2's default, True except for the root group. An int N (between 1
        # and the shard size) reshards to groups of N ranks after forward.
        self._reshard_after_forward: bool | None = None
        self.post_forward_mesh: PostForwardMesh | None = None
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.unshard_in_backward = True
        # Eager: all-gathers refill one storage per parameter that outlives reshard.
        self.keep_unsharded_storage = False
        # Gradient reduction.
        self.requires_all_reduce = True
        self.gradient_divide_factor: float | None = None
        self.force_sum_reduction = False
        self.reduce_scatter_unused_params = False
        self.all_reduce_hook: Callable[[torch.Tensor], None] | None = None
        self.all_reduce_hook_stream: torch.Stream | None = None
        # Custom comms and the streams the eager collectives run on.
        self.all_gather_comm: AllGather | None = None
        self.reduce_scatter_comm: ReduceScatter | None = None
        self.streams = comm.DeviceStreams(torch.device(mesh.device_type))
        # FSDP2's _set_unshard_async_op(True): the copy-in on the current stream.
        self.unshard_async_op = False
        # Whether the group's module sits inside a torch checkpoint_wrapper (set when the
        # root links the groups; see [Note: activation checkpointing]).
        self.inside_checkpoint_wrapper = False
        # Prefetch: whether set explicitly, and what the group's backward prefetches
        # (set when the root links the groups, or by set_modules_to_backward_prefetch).
        self.explicit_forward_prefetch = False
        self.explicit_backward_prefetch = False
        self.prefetch_backward: Callable[[], None] | None = None

    @property
    def reshard_after_forward(self) -> bool:
        """Whether backward re-gathers the parameters (by default, all but the root group)."""
        if self._reshard_after_forward is None:
            return not self.is_root
        return self._reshard_after_forward

    @reshard_after_forward.setter
    def reshard_after_forward(self, value: bool | int | None) -> None:
        if isinstance(value, bool) or value is None:
            self._reshard_after_forward, self.post_forward_mesh = value, None
        else:
            self._reshard_after_forward = True
            self.post_forward_mesh = PostForwardMesh(self._mesh, value)

    def configure(self, **settings: object) -> None:
        """Sets settings (see [Note: group settings]).

        Args:
            settings: setting name -> new value, e.g. ``reshard_after_backward=False``.

        Raises:
            AttributeError: a name that is not a setting.
        """
        for name, value in settings.items():
            if name not in SETTINGS:
                raise AttributeError(f"{name!r} is not a setting of a parameter group")
            setattr(self, name, value)
