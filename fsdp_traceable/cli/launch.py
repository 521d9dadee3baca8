"""Runs a command's per-rank body: on the ranks ``torchrun`` launched, or on local gloo ranks."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from ..testing.local_ranks import (
    init_default_group,
    run_and_shut_down,
    run_on_local_ranks,
)


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def device_type() -> str:
    """``cuda`` under torchrun on a GPU machine, else ``cpu``."""
    return "cuda" if launched_by_torchrun() and torch.cuda.is_available() else "cpu"


def _call(rank: int, world_size: int, fn: Callable[..., Any], *args: Any) -> None:
    fn(*args)


def resolve_device(device: str) -> str:
    """``"cpu"`` or ``"cuda"`` for a ``--device`` value: ``"auto"`` is ``cuda`` under
    ``torchrun`` on a GPU machine, else ``cpu``; ``"cuda"`` needs a GPU."""
    if device == "auto":
        return device_type()
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda needs a GPU, and torch sees none: use --device cpu")
    return device


def run_on_ranks(
    fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 300.0,
    device: str = "auto",
) -> None:
    """Runs ``fn(*args)`` on every rank with the default process group initialized.

    Under ``torchrun`` this process is one rank (NCCL on GPUs, gloo on CPU); otherwise
    ``world_size`` local ranks are spawned on 127.0.0.1: gloo on CPU, NCCL with one
    GPU per rank for ``device="cuda"``. ``fn`` must be a module-level function.

    Args:
        fn: the per-rank body.
        args: its arguments.
        world_size: ranks to spawn when not under ``torchrun``.
        timeout_s: collective timeout: a rank that waits longer raises instead of hanging.
        device: ``"auto"``, ``"cpu"`` or ``"cuda"`` (see :func:`resolve_device`).
    """
    device = resolve_device(device)
    backend = "nccl" if device == "cuda" else "gloo"
    if launched_by_torchrun():
        init_default_group(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None,
                           timeout_s, backend=backend)
        run_and_shut_down(fn, args)
        return
    if device == "cuda" and world_size > torch.cuda.device_count():
        raise ValueError(
            f"--world-size {world_size} on {torch.cuda.device_count()} GPU(s): NCCL runs one "
            "rank per GPU; lower --world-size, or launch with torchrun on more GPUs"
        )
    run_on_local_ranks(_call, world_size, fn, *args, timeout_s=timeout_s, backend=backend,
                       num_threads=max(1, (os.cpu_count() or 1) // world_size))
