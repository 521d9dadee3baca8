"""Runs a function on every rank: the ranks ``torchrun`` launched, or local gloo ranks."""

from __future__ import annotations

import datetime
import gc
import os
import socket
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def device_type() -> str:
    """``cuda`` under torchrun on a GPU machine, else ``cpu``."""
    return "cuda" if launched_by_torchrun() and torch.cuda.is_available() else "cpu"


def free_port() -> int:
    """A free TCP port on 127.0.0.1 for local ranks to meet at."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_default_group(
    rank: int, world_size: int, init_method: str | None, timeout_s: float,
    backend: str | None = None,
) -> None:
    """The default process group with a ``timeout_s`` collective timeout; ``backend``
    defaults to NCCL under ``torchrun`` on a GPU machine, else gloo."""
    backend = backend or ("nccl" if device_type() == "cuda" else "gloo")
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _local_rank_main(rank: int, world_size: int, port: int, fn, args, timeout_s: float) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    init_default_group(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s)
    run_and_shut_down(fn, args)


def run_and_shut_down(fn: Callable[..., Any], args: tuple) -> None:
    """Runs ``fn``; after a success every rank meets at a barrier before tearing down,
    so no rank closes its connections while a peer is still using them (gloo aborts
    the peer's process then). After a failure the ranks tear down at once."""
    try:
        fn(*args)
        dist.barrier()
    finally:
        shut_down_process_group()


def shut_down_process_group() -> None:
    """Destroys the default process group, then drops what may still hold a process
    group: compiled code keeps its model alive, and the model's parameter groups keep
    their process group. Released here, a gloo process group is destroyed while the
    interpreter is whole; destroyed during interpreter shutdown, with work still held by
    its threads, it can abort the process."""
    dist.destroy_process_group()
    torch._dynamo.reset()
    gc.collect()


def run_on_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 300.0
) -> None:
    """Runs ``fn(*args)`` on every rank with the default process group initialized.

    Under ``torchrun`` this process is one rank (NCCL on GPUs, gloo on CPU); otherwise
    ``world_size`` local gloo ranks are spawned on 127.0.0.1. ``fn`` must be a
    module-level function.

    Args:
        fn: the per-rank body.
        args: its arguments.
        world_size: ranks to spawn when not under ``torchrun``.
        timeout_s: collective timeout: a rank that waits longer raises instead of hanging.
    """
    if launched_by_torchrun():
        init_default_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, timeout_s)
        run_and_shut_down(fn, args)
        return
    mp.start_processes(
        _local_rank_main, args=(world_size, free_port(), fn, args, timeout_s),
        nprocs=world_size, join=True, start_method="spawn",
    )
