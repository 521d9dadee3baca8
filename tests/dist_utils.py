"""Runs a test body on real gloo ranks (processes on 127.0.0.1)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

from fsdp_traceable.launch import free_port, init_default_group, run_and_shut_down

__all__ = ["free_port", "run_on_ranks"]


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
    init_default_group(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s, backend="gloo")

    def run_and_save() -> None:
        torch.save(fn(rank, world_size, *args), os.path.join(result_dir, f"rank{rank}.pt"))

    run_and_shut_down(run_and_save, ())


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
