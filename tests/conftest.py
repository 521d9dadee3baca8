"""Fixtures shared by ``tests/`` and ``compile_tests/``: a fake process group for
single-process graph tests, a fake mesh, collectives that fail if reached, and a
fresh Inductor cache.

Real multi-rank tests spawn gloo processes with
:func:`fsdp_traceable.testing.local_ranks.run_on_local_ranks`.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fsdp_traceable.collectives import comm
from fsdp_traceable.testing.fake_world import fake_process_group


@pytest.fixture
def fake_world() -> Iterator[None]:
    """Rank 0 of a 2-rank fake process group, with Dynamo's caches and counters reset
    before and after."""
    with fake_process_group(2):
        yield


@pytest.fixture
def one_gloo_rank(tmp_path: Path) -> Iterator[None]:
    """A real one-rank gloo default group, with Dynamo reset before and after: its
    collectives move data (the fake group's do not), in this process."""
    store = dist.FileStore(str(tmp_path / "gloo_store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch._dynamo.reset()
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


@pytest.fixture
def fake_mesh() -> Iterator[DeviceMesh]:
    """A 1-D CPU mesh over a 2-rank fake process group (rank 0)."""
    with fake_process_group(2, reset_dynamo=False):
        yield init_device_mesh("cpu", (2,))


@pytest.fixture
def fresh_inductor_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty ``TORCHINDUCTOR_CACHE_DIR`` and Inductor's caches off: the on-disk
    cache ignores custom decompositions and could serve stale kernels."""
    cache_dir = tmp_path / "inductor_cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache_dir))
    with torch._inductor.config.patch(force_disable_caches=True):
        yield cache_dir


def _fail_collective(*args: object, **kwargs: object) -> None:
    raise AssertionError("a collective started before the bad input was rejected")


@pytest.fixture
def no_collectives(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every collective primitive raises: bad input must be rejected before one starts."""
    for name in ("all_gather", "all_gather_into", "start_reduce_scatter", "all_reduce", "wait"):
        monkeypatch.setattr(comm, name, _fail_collective)
