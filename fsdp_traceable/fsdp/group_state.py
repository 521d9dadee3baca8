"""The named runtime states of a parameter group's forward side (see
:class:`~.param_group.ParamGroup`)."""

from __future__ import annotations

import enum


class GroupState(enum.Enum):
    """Where a group's unsharded parameters are, between forwards and during one.

    Traced forwards move through the same states as eager ones (Dynamo replays the
    writes); the eager backward's own state (parameters re-gathered for backward,
    no-sync gradients) is the group's ``EagerState``.
    """

    SHARDED = enum.auto()
    """Only the local shards are held (or a forward of the group's single module is
    running, with its parameters bound): the next forward all-gathers."""
    UNSHARDED = enum.auto()
    """:meth:`ParamGroup.unshard` gathered and bound them; the next forward takes them,
    :meth:`ParamGroup.reshard` drops them."""
    LIST_FORWARD = enum.auto()
    """A ``fully_shard([a, b])`` group's forward pass: its modules still to run reuse
    them; the last one (or the root's forward, at the latest) releases them."""
