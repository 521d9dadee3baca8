"""``config.copy_kernels`` is honoured by the foreach collectives, with identical bits.

On 2 gloo ranks: the all-gather round trip and a reduce run under each setting
(``"triton"`` through the Triton interpreter on CPU), the implementation that the
setting names is the one that ran, and every setting gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist

import fsdp_traceable
from fsdp_traceable.collectives import copy_backends
from fsdp_traceable.testing.local_ranks import run_on_local_ranks

pytestmark = pytest.mark.gloo
SIZES = (((7, 5), 0), ((3,), 0), ((4, 6), 1), ((1,), 0))


def _body(rank: int, world_size: int) -> dict[str, object]:
    os.environ["TRITON_INTERPRET"] = "1"
    group = dist.group.WORLD
    torch.manual_seed(0)
    fulls = [torch.randn(size) for size, _ in SIZES]
    infos = [fsdp_traceable.make_shard_info(size, world_size, rank, shard_dim=dim,
                                            param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
             for size, dim in SIZES]
    shards = [fsdp_traceable.shard_tensor(f, i) for f, i in zip(fulls, infos)]
    grads = [(f * (rank + 1)).to(torch.bfloat16) for f in fulls]
    results, calls = {}, Counter()
    foreach, triton = copy_backends.COPY_BACKENDS["foreach"], copy_backends.COPY_BACKENDS["triton"]

    def triton_serves(tensors):
        served = triton.serves(tensors)
        calls["triton"] += served
        return served

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    copy_backends.COPY_BACKENDS["foreach"] = dataclasses.replace(foreach, **{
        name: counted(f"foreach.{name}", getattr(foreach, name))
        for name in ("all_gather_copy_in_into", "all_gather_copy_out", "reduce_scatter_copy_in")
    })
    copy_backends.COPY_BACKENDS["triton"] = dataclasses.replace(triton, serves=triton_serves)
    try:
        for mode in ("inductor", "foreach", "triton"):
            with fsdp_traceable.config.patch(copy_kernels=mode):
                gathered = fsdp_traceable.foreach_all_gather_copy_out(
                    fsdp_traceable.foreach_all_gather(shards, infos, group))
                reduced = fsdp_traceable.foreach_reduce(grads, infos, group).sharded_grads
            results[mode] = [t.clone() for t in gathered + reduced]
    finally:
        copy_backends.COPY_BACKENDS.update(foreach=foreach, triton=triton)
    return {"results": results, "calls": dict(calls)}


def test_every_copy_kernel_setting_gives_the_same_bits() -> None:
    for outcome in run_on_local_ranks(_body, 2):
        results = outcome["results"]
        for mode in ("foreach", "triton"):
            for a, b in zip(results["inductor"], results[mode]):
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a,
                                   b.view(-1).view(torch.uint8) if b.numel() else b), mode
        # The foreach setting ran the foreach kernels, once per copy.
        # Each setting ran its own kernels: foreach once per copy, Triton (interpreted)
        # for the copy-in, copy-out and reduce-scatter copy-in.
        assert outcome["calls"] == {"foreach.all_gather_copy_in_into": 1,
                                    "foreach.all_gather_copy_out": 1,
                                    "foreach.reduce_scatter_copy_in": 1, "triton": 3}
