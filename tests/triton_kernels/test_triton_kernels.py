"""The Triton copy kernels against the aten ops, bit for bit, in the Triton interpreter.

CPU tensors always run the interpreted build of the kernels (``triton_kernels.loader``
builds it whatever ``TRITON_INTERPRET`` said at import), so these tests need no GPU
and no environment variable. Each copy test runs both kernel variants (the ``variant``
fixture): the table-driven kernels of the eager path and the kernels generated per
bucket for the traced path, with a block size small enough that parameters span
several programs. The traced GPU path itself is checked by tracing on fake CUDA
tensors (the kernel is not run).
"""

from __future__ import annotations

import pytest
import torch

import fsdp_traceable  # noqa: F401  (registers torch.ops.fsdp_traceable)
from tests.collectives.copy_cases import (
    F32_SPECIALS,
    assert_same_bits,
    bucket,
    copy_out_args,
    full_tensors,
    gathered,
    rank_shards,
)

pytestmark = pytest.mark.triton

triton_kernels = pytest.importorskip("triton_kernels.ops", reason="triton is not installed")
from triton_kernels import launch, unsharded_views  # noqa: E402
from triton_kernels import layout as layouts  # noqa: E402

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
WORLD_SIZES = (1, 2, 3, 4)
CASTS = [(F32, BF16), (F32, F16), (BF16, F32), (F32, F32)]


def _interpreter_runs() -> str | None:
    try:
        out = torch.ops.fsdp_traceable_triton.all_gather_copy_in([torch.ones(3)], [4], F32)
    except Exception as error:  # pragma: no cover - depends on the installation
        return f"the Triton interpreter cannot run here: {error!r}"
    return None if out.tolist() == [1.0, 1.0, 1.0, 0.0] else "the Triton interpreter is broken"


_SKIP = _interpreter_runs()
if _SKIP:
    pytest.skip(_SKIP, allow_module_level=True)


@pytest.fixture(params=["tables", "generated"])
def variant(request, monkeypatch):
    """Runs each test with the eager (table) and the traced (generated) kernels, and a
    block of 64 elements (the interpreter runs programs one by one)."""
    monkeypatch.setattr(launch, "always_generated_kernels", request.param == "generated")
    monkeypatch.setattr(layouts, "DEFAULT_BLOCK", 64)
    return request.param


@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("src,dst", CASTS, ids=lambda d: str(d).removeprefix("torch."))
def test_all_gather_copy_in_matches_aten(world_size, src, dst):
    params = bucket(world_size)
    fulls = full_tensors(params, [src] * len(params))
    for rank in range(world_size):
        shards, padded = rank_shards(params, fulls, world_size, rank)
        actual = torch.ops.fsdp_traceable_triton.all_gather_copy_in(shards, padded, dst)
        expected = torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, dst)
        assert_same_bits(actual, expected)


@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("world_size", (2, 3))
def test_all_gather_copy_in_mixed_dtypes(world_size):
    """Mixed source dtypes cast to one dtype, and a mixed bucket packed as bytes."""
    params = bucket(world_size)
    dtypes = [(F32, BF16, F16)[i % 3] for i in range(len(params))]
    fulls = full_tensors(params, dtypes)
    for rank in range(world_size):
        shards, padded = rank_shards(params, fulls, world_size, rank)
        for dst in (BF16, torch.uint8):
            actual = torch.ops.fsdp_traceable_triton.all_gather_copy_in(shards, padded, dst)
            expected = torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, dst)
            assert_same_bits(actual, expected)


@pytest.mark.usefixtures("variant")
def test_all_gather_copy_in_empty_shards_and_padding():
    shards = [torch.arange(10.0), torch.empty(0), torch.arange(3.0).view(3, 1), torch.empty(0)]
    padded = [12, 5, 3, 0]
    actual = torch.ops.fsdp_traceable_triton.all_gather_copy_in(shards, padded, BF16)
    assert_same_bits(actual, torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, BF16))


@pytest.mark.usefixtures("variant")
def test_all_gather_copy_in_into_writes_the_slice():
    """The eager ``_into`` variant fills exactly the given slice of a larger buffer."""
    params = bucket(3)
    fulls = full_tensors(params, [F32] * len(params))
    shards, padded = rank_shards(params, fulls, 3, 1)
    expected = torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, BF16)
    buffer = torch.full((3 * expected.numel(),), 7.0, dtype=BF16)
    triton_kernels.all_gather_copy_in_into(shards, padded, buffer[expected.numel() : 2 * expected.numel()])
    assert_same_bits(buffer[expected.numel() : 2 * expected.numel()], expected)
    assert (buffer[: expected.numel()] == 7).all() and (buffer[2 * expected.numel() :] == 7).all()


@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("src,dst", CASTS, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("predivide", [None, 3.0])
def test_reduce_scatter_copy_in_matches_aten(world_size, src, dst, predivide):
    params = bucket(world_size)
    grads = full_tensors(params, [src] * len(params), seed=world_size)
    dims = [p.shard_dim for p in params]
    actual = torch.ops.fsdp_traceable_triton.reduce_scatter_copy_in(grads, world_size, dims, dst, predivide)
    expected = torch.ops.fsdp_traceable.reduce_scatter_copy_in(grads, world_size, dims, dst, predivide)
    assert_same_bits(actual, expected)


@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=str)
def test_all_gather_copy_out_matches_aten(world_size, dtype):
    params = bucket(world_size)
    fulls = full_tensors(params, [dtype] * len(params))
    output = gathered(params, fulls, world_size, dtype)
    sizes_flat, ndims, dims = copy_out_args(params, world_size)
    flat = torch.ops.fsdp_traceable_triton.all_gather_copy_out(
        output, world_size, sizes_flat, ndims, dims, [dtype.itemsize] * len(params))
    views = unsharded_views(flat, sizes_flat, ndims, [dtype] * len(params))
    expected = torch.ops.fsdp_traceable.all_gather_copy_out(
        output, world_size, sizes_flat, ndims, dims, [dtype] * len(params))
    _check_copy_out(flat, views, expected, fulls)


@pytest.mark.usefixtures("variant")
@pytest.mark.parametrize("world_size", (2, 3))
def test_all_gather_copy_out_bytes(world_size):
    """A mixed-dtype bucket gathered as bytes comes out as views of each dtype."""
    params = bucket(world_size)
    dtypes = [(F32, BF16, F16)[i % 3] for i in range(len(params))]
    fulls = full_tensors(params, dtypes)
    output = gathered(params, fulls, world_size, torch.uint8)
    sizes_flat, ndims, dims = copy_out_args(params, world_size)
    flat = torch.ops.fsdp_traceable_triton.all_gather_copy_out(
        output, world_size, sizes_flat, ndims, dims, [d.itemsize for d in dtypes])
    views = unsharded_views(flat, sizes_flat, ndims, dtypes)
    expected = torch.ops.fsdp_traceable.all_gather_copy_out(
        output, world_size, sizes_flat, ndims, dims, dtypes)
    _check_copy_out(flat, views, expected, fulls)


def _check_copy_out(flat, views, expected, fulls):
    """Views equal the aten outputs and the original tensors (NaN payloads too: a copy
    moves bits), are contiguous and 16-byte aligned, and everything else is zero."""
    covered = torch.zeros(flat.numel(), dtype=torch.bool)
    for view, ref, full in zip(views, expected, fulls):
        assert view.is_contiguous()
        assert (view.data_ptr() - flat.data_ptr()) % 16 == 0
        assert_same_bits(view, ref, nan_payloads=True)
        assert_same_bits(view, full, nan_payloads=True)
        start = (view.data_ptr() - flat.data_ptr()) // flat.element_size()
        covered[start : start + view.numel() * view.element_size() // flat.element_size()] = True
    assert not flat[~covered].view(torch.uint8 if flat.element_size() == 1 else torch.int16).any()


def _f32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(F32)


@pytest.mark.usefixtures("variant")
def test_casts_round_to_nearest_even_at_every_tie(monkeypatch):
    """Every fp16 and bf16 value widened to fp32, and fp32 values at every fp16 and
    bf16 rounding tie (the midpoints between consecutive finite values, and one fp32
    ulp either side), plus random fp32 bit patterns, narrowed."""
    monkeypatch.setattr(layouts, "DEFAULT_BLOCK", 2**16)  # few, wide interpreted programs
    ints16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    for narrow in (F16, BF16):
        every = ints16.view(narrow)
        assert_same_bits(
            torch.ops.fsdp_traceable_triton.all_gather_copy_in([every], [every.numel()], F32),
            every.to(F32),
        )
    finite16 = torch.arange(0, 0x7C00, dtype=torch.int32).to(torch.int16).view(F16).to(F32)
    # Exact: fp16 has 11 significant bits, fp32 24. Includes the tie 65520 (-> inf).
    mid16 = ((finite16[:-1].double() + finite16[1:].double()) / 2).to(F32)
    mid16 = torch.cat([mid16, torch.tensor([65520.0])])
    mid_bf16 = _f32((torch.arange(0, 0x7F80, dtype=torch.int32) << 16) | 0x8000)
    gen = torch.Generator().manual_seed(0)
    random_bits = torch.randint(-(2**31), 2**31 - 1, (20000,), generator=gen, dtype=torch.int64)
    values = []
    for mids in (mid16, mid_bf16):
        bits = mids.view(torch.int32)
        for delta in (-1, 0, 1):
            values += [_f32(bits + delta), -_f32(bits + delta)]
    values += [_f32(random_bits), torch.tensor(F32_SPECIALS)]
    source = torch.cat(values)
    for narrow in (F16, BF16):
        actual = torch.ops.fsdp_traceable_triton.all_gather_copy_in([source], [source.numel()], narrow)
        assert_same_bits(actual, source.to(narrow))


def test_layouts_and_tables_are_cached():
    """The per-bucket metadata is built once: the same layout object and the same
    device tables come back for the same bucket description."""
    first = layouts.chunk_layout(((4, 6), (5,)), (1, 0), 2, (0, 0), 32)
    assert layouts.chunk_layout(((4, 6), (5,)), (1, 0), 2, (0, 0), 32) is first
    meta, blocks = layouts.device_tables(first, torch.device("cpu"))
    again = layouts.device_tables(first, torch.device("cpu"))
    assert again[0] is meta and again[1] is blocks
    # (4, 6) Shard(1) at 2 ranks: 4 rows of 3; (5,) Shard(0): ceil(5 / 2) = 3 per rank.
    assert first.row_numel == 12 + 3
    assert meta[:, :4].tolist() == [[0, 12, 3, 24], [12, 3, 3, 5]]


@pytest.mark.parametrize(
    "name,args",
    [
        ("all_gather_copy_in", lambda: ([torch.randn(5, 3), torch.randn(7)], [16, 8], BF16)),
        ("reduce_scatter_copy_in", lambda: ([torch.randn(5, 3), torch.randn(4, 6)], 2, [0, 1], BF16, 2.0)),
        ("all_gather_copy_out", lambda: (torch.randn(24), 2, [4, 3, 2, 6], [2, 2], [0, 1], [4, 4])),
    ],
)
def test_opcheck(name, args):
    """Schema, fake (the traced CPU path decomposes into the aten ops) and AOT dispatch."""
    op = getattr(torch.ops.fsdp_traceable_triton, name).default
    torch.library.opcheck(op, args())


def _trace_on_fake_cuda(fn, *sizes):
    """``fn`` traced the way AOTAutograd does (functionalized, fake tensors) on fake
    CUDA tensors: no GPU is needed to see which kernel call the traced path emits."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._subclasses.functional_tensor import (
        FunctionalTensorMode,
        dispatch_functionalize,
    )
    from torch.fx.experimental.proxy_tensor import make_fx

    with FakeTensorMode():
        args = [torch.empty(size, device="cuda") for size in sizes]
    return make_fx(dispatch_functionalize(fn, FunctionalTensorMode()), tracing_mode="fake")(*args)


@pytest.mark.parametrize("op", ["all_gather_copy_in", "reduce_scatter_copy_in", "all_gather_copy_out"])
def test_traced_gpu_path_is_one_kernel_reading_every_source(op):
    """Traced on GPU, each op is ONE ``triton_kernel_wrapper_functional`` node taking
    every source tensor as an argument, with no metadata constants in the graph."""
    if op == "all_gather_copy_in":
        graph = _trace_on_fake_cuda(
            lambda a, b, c: torch.ops.fsdp_traceable_triton.all_gather_copy_in([a, b, c], [16, 4, 6], BF16),
            (15,), (3,), (2, 3))
        sources = 3
    elif op == "reduce_scatter_copy_in":
        graph = _trace_on_fake_cuda(
            lambda a, b: torch.ops.fsdp_traceable_triton.reduce_scatter_copy_in([a, b], 2, [0, 1], BF16, 3.0),
            (5, 3), (2, 6))
        sources = 2
    else:
        graph = _trace_on_fake_cuda(
            lambda x: torch.ops.fsdp_traceable_triton.all_gather_copy_out(x, 2, [4, 3, 2, 6], [2, 2], [0, 1], [4, 4]),
            (24,))
        sources = 0
    calls = [n for n in graph.graph.nodes if n.target is torch.ops.higher_order.triton_kernel_wrapper_functional]
    assert len(calls) == 1
    kwargs = calls[0].kwargs["kwargs"]
    assert [k for k in kwargs if k.startswith("src_")] == [f"src_{i}" for i in range(sources)]
    assert not [n for n in graph.graph.nodes if n.op == "get_attr"], graph.code


def _symbolic_fake_cuda_calls():
    """Each op called on fake CUDA tensors whose sizes, world size and size arguments
    are symbolic, as Dynamo passes them once it recompiles with automatic dynamic
    shapes; and the same calls with plain ints."""
    from torch._dynamo.source import ConstantSource
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()

    def sym(value: int, name: str):
        symbol = env.create_symbol(value, ConstantSource(name), dynamic_dim=DimDynamic.DYNAMIC)
        return env.create_symintnode(symbol, hint=value)

    ops = torch.ops.fsdp_traceable_triton

    def calls(size):
        a = torch.empty(size(6, "a0"), 3, device="cuda")
        b = torch.empty(2, size(6, "b1"), device="cuda")
        world = size(2, "world")
        gathered = torch.empty(size(24, "gathered"), device="cuda")
        return [
            ops.all_gather_copy_in([a, b], [a.numel(), b.numel()], BF16),
            ops.reduce_scatter_copy_in([a, b], world, [0, size(1, "dim")], BF16, 3.0),
            ops.all_gather_copy_out(gathered, world, [4, size(3, "g1"), 2, 6], [2, 2], [0, 1],
                                    [4, 4]),
        ]

    with FakeTensorMode(shape_env=env):
        return calls(sym), calls(lambda value, name: value)


def test_traced_ops_specialize_symbolic_sizes():
    """Traced with symbolic shapes (``dynamic=True``, or automatic dynamic after a
    recompile), each op's fake impl builds its layout from the sizes' values: same
    output sizes as with plain ints, and a guard per size, not a hashing error."""
    symbolic, static = _symbolic_fake_cuda_calls()
    assert [tuple(t.shape) for t in symbolic] == [tuple(t.shape) for t in static]
    assert all(isinstance(d, int) for t in symbolic for d in t.shape)
