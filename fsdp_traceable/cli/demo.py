"""A small runnable demo: a bucket of parameters all-gathered and reduced on local gloo ranks.

Two (or more) spawned gloo ranks shard a few parameters, all-gather them back with
:func:`~fsdp_traceable.foreach_all_gather` + :func:`~fsdp_traceable.foreach_all_gather_copy_out`
and reduce a bucket of gradients with :func:`~fsdp_traceable.foreach_reduce`, checking both
against single-process math and printing what happened.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..collectives import (
    foreach_all_gather,
    foreach_all_gather_copy_out,
    foreach_reduce,
    make_shard_info,
    shard_tensor,
)
from .launch import run_on_ranks

# (global size, shard dim) of the demo bucket: uneven dim 0, a vector, a Shard(1).
DEMO_PARAMS: tuple[tuple[tuple[int, ...], int], ...] = (
    ((5, 3), 0),
    ((4,), 0),
    ((2, 6), 1),
)


def _demo_rank() -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # every rank builds the same full parameters
    fulls = [torch.randn(size) for size, _ in DEMO_PARAMS]
    infos = [
        make_shard_info(size, world_size, rank, shard_dim=dim)
        for size, dim in DEMO_PARAMS
    ]
    shards = [shard_tensor(full, info) for full, info in zip(fulls, infos)]
    group = dist.group.WORLD

    gathered = foreach_all_gather_copy_out(foreach_all_gather(shards, infos, group))
    gather_ok = all(torch.equal(g, f) for g, f in zip(gathered, fulls))

    # Rank r contributes (r + 1) * full; the averaged gradient is mean(1..world) * full.
    grads = [full * (rank + 1) for full in fulls]
    reduced = foreach_reduce(grads, infos, group).sharded_grads
    scale = (world_size + 1) / 2
    expected = [shard_tensor(full * scale, info) for full, info in zip(fulls, infos)]
    reduce_ok = all(torch.allclose(r, e) for r, e in zip(reduced, expected))

    lines = [f"[rank {rank}] bucket of {len(infos)} parameters"]
    for info, shard, grad in zip(infos, shards, reduced):
        lines.append(
            f"[rank {rank}]   global {tuple(info.global_size)} Shard({info.shard_dim}): "
            f"shard {tuple(shard.shape)} -> sharded grad {tuple(grad.shape)}"
        )
    lines.append(f"[rank {rank}] all-gather + copy-out equals the full parameters: {gather_ok}")
    lines.append(f"[rank {rank}] reduce-scatter (avg) equals the mean gradient: {reduce_ok}")
    # Print rank by rank so the lines do not interleave.
    for turn in range(world_size):
        if turn == rank:
            print("\n".join(lines), flush=True)
        dist.barrier()
    if not (gather_ok and reduce_ok):
        raise RuntimeError(f"rank {rank}: demo results do not match the reference")


def run_demo(world_size: int = 2) -> None:
    """Runs the demo on ``world_size`` local gloo processes.

    Args:
        world_size: number of ranks to spawn (at least 1).

    Raises:
        ValueError: ``world_size`` is below 1.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    run_on_ranks(_demo_rank, world_size=world_size, timeout_s=60)
    print(f"demo done: {world_size} gloo ranks, all-gather and reduce match the reference")
