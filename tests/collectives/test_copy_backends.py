"""``config.copy_kernels`` picks the implementation; every choice gives the aten ops' bits."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from fsdp_traceable import config
from fsdp_traceable.collectives import copy_backends
from tests.collectives.copy_cases import (
    assert_same_bits,
    bucket,
    copy_out_args,
    full_tensors,
    gathered,
    rank_shards,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
HAS_TRITON = importlib.util.find_spec("triton") is not None
WORLD = 3


def _run_bucket(copies) -> list[torch.Tensor]:
    """Every copy of a world-3 bucket through ``copies`` (the dispatch module or the
    aten reference): copy-in (cast and bytes), copy-in into a slice, copy-out (one
    dtype and bytes), reduce-scatter copy-in with a pre-divide."""
    params = bucket(WORLD)
    mixed = [(F32, BF16, F16)[i % 3] for i in range(len(params))]
    fulls32, fulls_mixed = full_tensors(params, [F32] * len(params)), full_tensors(params, mixed)
    results = []
    for rank in range(WORLD):
        shards, padded = rank_shards(params, fulls32, WORLD, rank)
        results.append(copies.all_gather_copy_in(shards, padded, BF16))
        mixed_shards, _ = rank_shards(params, fulls_mixed, WORLD, rank)
        results.append(copies.all_gather_copy_in(mixed_shards, padded, torch.uint8))
        out = torch.full((results[-2].numel() + 2,), 5.0, dtype=BF16)
        copies.all_gather_copy_in_into(shards, padded, out[1:-1])
        results.append(out)
    sizes_flat, ndims, dims = copy_out_args(params, WORLD)
    for fulls, gather_dtype, dtypes in ((fulls32, BF16, [BF16] * len(params)),
                                        (fulls_mixed, torch.uint8, mixed)):
        output = gathered(params, fulls, WORLD, gather_dtype)
        outs = copies.all_gather_copy_out(output, WORLD, sizes_flat, ndims, dims, dtypes)
        assert all(o.is_contiguous() for o in outs)
        results += outs
    results.append(copies.reduce_scatter_copy_in(fulls32, WORLD, dims, BF16, 3.0))
    return results


class _Aten:
    all_gather_copy_in = staticmethod(torch.ops.fsdp_traceable.all_gather_copy_in)
    all_gather_copy_out = staticmethod(torch.ops.fsdp_traceable.all_gather_copy_out)
    reduce_scatter_copy_in = staticmethod(torch.ops.fsdp_traceable.reduce_scatter_copy_in)

    @staticmethod
    def all_gather_copy_in_into(shards, padded, out):
        from fsdp_traceable.collectives.ops import all_gather_copy_in_into

        all_gather_copy_in_into(shards, padded, out)


@pytest.mark.parametrize(
    "mode",
    ["auto", "inductor", "foreach",
     pytest.param("triton", marks=[pytest.mark.triton,
                                   pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")])],
)
def test_every_mode_matches_aten(mode, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with config.patch(copy_kernels=mode):
        actual = _run_bucket(copy_backends)
    for got, want in zip(actual, _run_bucket(_Aten), strict=True):
        assert_same_bits(got, want)


@pytest.mark.triton
@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("interpret", [True, False])
def test_triton_mode_on_cpu_needs_the_interpreter(interpret, monkeypatch):
    """On CPU, ``"triton"`` launches the kernels only with ``TRITON_INTERPRET=1``."""
    from fsdp_traceable.triton_kernels import ops as triton_ops

    launched = []
    for name in ("launch_pack", "launch_unpack"):
        real = getattr(triton_ops, name)
        monkeypatch.setattr(triton_ops, name,
                            lambda *args, real=real, **kwargs: launched.append(real) or real(*args, **kwargs))
    if interpret:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    full = [torch.randn(5, 3), torch.randn(4)]
    rank_shards = [[full[0][:3], full[1][:2]], [full[0][3:], full[1][2:]]]
    with config.patch(copy_kernels="triton"):
        inputs = [copy_backends.all_gather_copy_in(s, [9, 2], BF16) for s in rank_shards]
        outs = copy_backends.all_gather_copy_out(
            torch.cat(inputs), 2, [5, 3, 4], [2, 1], [0, 0], [BF16, BF16])
        grads = copy_backends.reduce_scatter_copy_in(full, 2, [0, 0], F32, 2.0)
    assert len(launched) == (4 if interpret else 0)
    for shards, got in zip(rank_shards, inputs):
        assert_same_bits(got, torch.ops.fsdp_traceable.all_gather_copy_in(shards, [9, 2], BF16))
    for got, want in zip(outs, full):
        assert_same_bits(got, want.to(BF16))
    assert_same_bits(grads, torch.ops.fsdp_traceable.reduce_scatter_copy_in(full, 2, [0, 0], F32, 2.0))


def test_unknown_mode_is_rejected():
    with config.patch(copy_kernels="cuda"), pytest.raises(ValueError, match="copy_kernels='cuda'"):
        copy_backends.all_gather_copy_in([torch.ones(2)], [2], F32)


def test_compiled_cpu_takes_the_aten_path(monkeypatch):
    """Under ``torch.compile`` on CPU, ``"triton"`` (Triton cannot run there) and
    ``"foreach"`` (``out=`` buffers) trace the functional aten ops: no graph break."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    # Rank 0 of (4, 4) Shard(1) and (3,) Shard(0) at 2 ranks.
    shards, grads = [torch.randn(4, 2), torch.randn(2)], [torch.randn(6, 4), torch.randn(3)]

    def copies(shards, grads):
        flat = copy_backends.all_gather_copy_in(shards, [8, 2], BF16)
        gathered = torch.cat([flat, flat.flip(0)])
        outs = copy_backends.all_gather_copy_out(gathered, 2, [4, 4, 3], [2, 1], [1, 0], [BF16, BF16])
        return flat, outs, copy_backends.reduce_scatter_copy_in(grads, 2, [1, 0], BF16, 2.0)

    with config.patch(copy_kernels="triton"):
        compiled = torch.compile(copies, fullgraph=True, backend="aot_eager")(shards, grads)
    with config.patch(copy_kernels="inductor"):
        eager = copies(shards, grads)
    for got, want in zip(torch.utils._pytree.tree_leaves(compiled), torch.utils._pytree.tree_leaves(eager)):
        assert_same_bits(got, want)


def test_auto_takes_the_aten_ops_on_cpu():
    tensors = [torch.ones(2)]
    for copy in copy_backends.AUTO_TRACED_GPU:
        assert copy_backends.auto_backend(tensors, copy, 1) is copy_backends.ATEN


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_auto_on_a_gpu_takes_the_tile_kernels(monkeypatch):
    """Traced and eager, every copy of any bucket size takes the Triton tile kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [torch.empty(4, device="cuda")]

    def names(num_params: int) -> list[str]:
        return [copy_backends.auto_backend(tensors, copy, num_params).name
                for copy in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")]

    assert names(9) == names(1000) == ["triton", "triton", "triton"]
    monkeypatch.setattr(copy_backends, "is_tracing", lambda tensors=(): False)
    assert names(1000) == ["triton", "triton", "triton"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("copy_kernels", ["auto", "triton"])
def test_a_whole_step_with_regions_copies_out_into_a_buffer_per_parameter(
        monkeypatch, copy_kernels):
    """A region may not take or return tensors sharing storage: traced with forward
    regions, the copy-out on a GPU is aten's (a buffer per parameter), not Triton's (views
    of one); the other copies keep the tile kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [torch.empty(4, device="cuda")]
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(copy_backends, "is_tracing", lambda tensors=(): True)

    def names() -> list[str]:
        return [copy_backends.backend_for(tensors, copy, 9).name
                for copy in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")]

    with config.patch(copy_kernels=copy_kernels):
        assert names() == ["triton", "triton", "triton"]
        monkeypatch.setattr(copy_backends, "forward_regions_in_use", lambda: True)
        assert names() == ["triton", "inductor", "triton"]
