"""Runs a test body on real gloo ranks (processes on 127.0.0.1)."""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(
    rank: int,
    world_size: int,
    port: int,
    result_dir: str,
    fn: Callable[..., Any],
    args: tuple,
    timeout_s: float,
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(result_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes.

    ``fn`` must be a module-level function. A failure on any rank fails the call
    with that rank's traceback. Returns each rank's return value (``torch.save``-able).
    """
    with tempfile.TemporaryDirectory() as result_dir:
        mp.start_processes(
            _worker,
            args=(world_size, free_port(), result_dir, fn, args, timeout_s),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [
            torch.load(os.path.join(result_dir, f"rank{r}.pt"), weights_only=False)
            for r in range(world_size)
        ]
