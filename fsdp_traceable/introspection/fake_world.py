"""A single-process stand-in for the ranks: torch's fake process group.

Dynamo, AOTAutograd and Inductor trace and compile functional collectives on it as on
real ranks, so graph and compile tests need one process only; its collectives move
no data, so its numbers mean nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters

__all__ = ["fake_process_group"]


@contextlib.contextmanager
def fake_process_group(
    world_size: int = 2, rank: int = 0, *, reset_dynamo: bool = True
) -> Iterator[None]:
    """The default process group as rank ``rank`` of ``world_size`` fake ranks.

    Args:
        world_size: ranks the group pretends to have.
        rank: this process's rank in it.
        reset_dynamo: reset Dynamo's caches and counters on entry and exit, so every
            compile in the block is counted and nothing compiled for the group outlives it.

    Yields:
        Nothing; the group is destroyed on exit.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    if reset_dynamo:
        torch._dynamo.reset()
        counters.clear()
    try:
        yield
    finally:
        if reset_dynamo:
            torch._dynamo.reset()
        dist.destroy_process_group()
