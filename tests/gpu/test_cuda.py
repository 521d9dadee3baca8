"""What only a GPU can show: the CUDA copies and a world-1 NCCL training run.

Skipped without CUDA; ``make gpu-check`` runs them on a GPU machine with its stock
torch (no install), next to the kernel benchmarks.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import fsdp_traceable
from fsdp_traceable.collectives import copy_backends

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
WORLD = 4
SIZES = [((33, 8), 0), ((5,), 0), ((16, 12), 1), ((2, 3), 0)]


def _bucket(dtype: torch.dtype):
    torch.manual_seed(0)
    fulls = [torch.randn(size, device="cuda", dtype=dtype) * 100 for size, _ in SIZES]
    infos = [fsdp_traceable.make_shard_info(size, WORLD, 1, shard_dim=dim) for size, dim in SIZES]
    shards = [fsdp_traceable.shard_tensor(full, info) for full, info in zip(fulls, infos)]
    padded = [info.padded_sharded_numel for info in infos]
    return fulls, shards, padded, [dim for _, dim in SIZES]


def _copies(fulls, shards, padded, dims, reduce_dtype, factor):
    flat = copy_backends.all_gather_copy_in(shards, padded, BF16)
    gathered = torch.cat([flat] * WORLD)
    sizes_flat = [d for full in fulls for d in full.shape]
    ndims = [full.dim() for full in fulls]
    outs = copy_backends.all_gather_copy_out(gathered, WORLD, sizes_flat, ndims, dims,
                                             [BF16] * len(fulls))
    packed = copy_backends.reduce_scatter_copy_in(fulls, WORLD, dims, reduce_dtype, factor)
    return [flat, *outs, packed]


def _aten(fulls, shards, padded, dims, reduce_dtype, factor):
    with fsdp_traceable.config.patch(copy_kernels="inductor"):
        return _copies(fulls, shards, padded, dims, reduce_dtype, factor)


@pytest.mark.parametrize("reduce_dtype,factor", [(F16, 4.0), (BF16, None), (F32, 3.0)])
def test_auto_copies_are_the_aten_bits_eager_and_compiled(reduce_dtype, factor):
    bucket = _bucket(F32)
    expected = _aten(*bucket, reduce_dtype, factor)
    with fsdp_traceable.config.patch(copy_kernels="auto"):
        eager = _copies(*bucket, reduce_dtype, factor)
        torch._dynamo.reset()
        compiled = torch.compile(_copies, fullgraph=True)(*bucket, reduce_dtype, factor)
    for got_eager, got_compiled, want in zip(eager, compiled, expected, strict=True):
        assert torch.equal(got_eager.view(torch.uint8), want.view(torch.uint8))
        assert torch.equal(got_compiled.view(torch.uint8), want.view(torch.uint8))


@contextlib.contextmanager
def _nccl_world_of_one():
    import torch.distributed as dist

    store = dist.HashStore()
    dist.init_process_group("nccl", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_world_one_nccl_training_matches_fsdp2_eager_and_unsharded_compile():
    """bf16 parameters, fp32 reduce: our eager losses are FSDP2's bit for bit; our
    compiled and compiled-autograd losses within 1e-2 of FSDP2's after 4 steps."""
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fsdp_traceable.models.transformer import (
        Transformer,
        TransformerConfig,
        shard_transformer,
    )

    config = TransformerConfig(vocab_size=512, dim=256, n_layers=2, n_heads=4, max_seq_len=64)
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (4, 64), device="cuda")
    targets = torch.roll(tokens, 1, dims=1)

    def losses(fully_shard_fn, mode: str) -> list[float]:
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = shard_transformer(Transformer(config), fully_shard_fn, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn = model.loss if mode == "eager" else torch.compile(model.loss, fullgraph=True)
        backward = (torch._dynamo.compiled_autograd._enable(torch.compile())
                    if mode == "compile-ca" else contextlib.nullcontext())
        out = []
        for _ in range(4):
            loss = loss_fn(tokens, targets)
            with backward:
                loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            out.append(loss.item())
        torch._dynamo.reset()
        return out

    with _nccl_world_of_one():
        theirs = losses(fsdp2_fully_shard, "eager")
        assert losses(fsdp_traceable.fully_shard, "eager") == theirs
        for mode in ("compile", "compile-ca"):
            assert losses(fsdp_traceable.fully_shard, mode) == pytest.approx(theirs, abs=1e-2)


@pytest.mark.parametrize("built_on", ["cpu", "meta"])
def test_pinned_cpu_offload_matches_fsdp2(built_on: str):
    """``CPUOffloadPolicy(pin_memory=True)``, fp32, world-1 NCCL: every sharded parameter
    lives in pinned host memory (built on meta: after ``to_empty(device="cuda")``, which
    FSDP2 also moves back to pinned host memory), gradients land on the host, and eager
    losses and parameters are FSDP2's bit for bit; compiled autograd within 1e-5."""
    from torch.distributed.fsdp import CPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fsdp_traceable.models.transformer import (
        Transformer,
        TransformerConfig,
        shard_transformer,
    )

    config = TransformerConfig(vocab_size=384, dim=128, n_layers=2, n_heads=4, max_seq_len=32)
    policy = CPUOffloadPolicy(pin_memory=True)
    torch.manual_seed(0)
    tokens = torch.randint(0, config.vocab_size, (4, 32), device="cuda")
    targets = torch.roll(tokens, 1, dims=1)

    def train(fully_shard_fn, mode: str) -> dict:
        torch.manual_seed(0)
        with torch.device(built_on):
            model = Transformer(config)
        shard_transformer(model, fully_shard_fn, offload_policy=policy)
        if built_on == "meta":
            model.to_empty(device="cuda")
            torch.manual_seed(1)
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
        pinned = [p.to_local().is_pinned() for p in model.parameters()]
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loss_fn = model.loss if mode == "eager" else torch.compile(model.loss, fullgraph=True)
        backward = (torch._dynamo.compiled_autograd._enable(torch.compile(fullgraph=True))
                    if mode == "compile-ca" else contextlib.nullcontext())
        losses, grad_devices = [], set()
        for _ in range(3):
            loss = loss_fn(tokens, targets)
            with backward:
                loss.backward()
            grad_devices |= {p.grad.device.type for p in model.parameters()}
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        torch._dynamo.reset()
        return {"losses": losses, "pinned": pinned, "grad_devices": grad_devices,
                "params": [p.full_tensor().cpu() for p in model.parameters()]}

    with _nccl_world_of_one():
        theirs = train(fsdp2_fully_shard, "eager")
        ours = train(fsdp_traceable.fully_shard, "eager")
        compiled = train(fsdp_traceable.fully_shard, "compile-ca")
    assert all(theirs["pinned"]) and all(ours["pinned"]) and all(compiled["pinned"])
    assert ours["grad_devices"] == theirs["grad_devices"] == {"cpu"}
    assert ours["losses"] == theirs["losses"]
    for a, b in zip(theirs["params"], ours["params"], strict=True):
        assert torch.equal(a, b)
    assert compiled["losses"] == pytest.approx(theirs["losses"], abs=1e-5)
    for a, b in zip(theirs["params"], compiled["params"], strict=True):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


def test_compiled_copies_are_one_tile_kernel_each(inductor_cache):
    """Under ``torch.compile`` with ``"auto"``, each copy of a bucket is one call of its
    Triton op in Inductor's output code, no Inductor kernel touches the copies, and a
    call launches exactly one tile kernel per copy (two pack, one unpack)."""
    from torch._inductor.utils import run_and_get_code
    from torch.profiler import ProfilerActivity, profile

    from fsdp_traceable.introspection.inductor_code import schedule

    fulls, shards, padded, dims = _bucket(F32)
    gathered = torch.cat([copy_backends.all_gather_copy_in(shards, padded, BF16)] * WORLD)
    sizes_flat = [d for full in fulls for d in full.shape]
    ndims = [full.dim() for full in fulls]

    def copies(shards, gathered, grads):
        flat = copy_backends.all_gather_copy_in(shards, padded, BF16)
        outs = copy_backends.all_gather_copy_out(gathered, WORLD, sizes_flat, ndims, dims,
                                                 [BF16] * len(fulls))
        packed = copy_backends.reduce_scatter_copy_in(grads, WORLD, dims, BF16, 3.0)
        return [flat, *outs, packed]

    torch._dynamo.reset()
    with fsdp_traceable.config.patch(copy_kernels="auto"):
        compiled = torch.compile(copies, fullgraph=True)
        _, (code,) = run_and_get_code(compiled, shards, gathered, fulls)
        launches = [(launch.kind, launch.name) for launch in schedule(code)]
        assert sorted(launches) == [
            ("extern", f"torch.ops.fsdp_traceable_triton.{op}.default")
            for op in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")
        ], code
        compiled(shards, gathered, fulls)  # pointer tables cached: no copies to the GPU
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            compiled(shards, gathered, fulls)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    assert sorted(kernels) == ["pack_tiles", "pack_tiles", "unpack_tiles"], kernels
    torch._dynamo.reset()
