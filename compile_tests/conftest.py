"""Fixtures shared by the compile tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank 0 of a 2-rank fake process group, with Dynamo's caches and counters reset
    before and after."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    torch._dynamo.reset()
    counters.clear()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()
