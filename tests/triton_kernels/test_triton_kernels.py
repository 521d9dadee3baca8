"""The Triton copy kernels against the aten ops, bit for bit, in the Triton interpreter.

CPU tensors always run the interpreted build of the kernels (``triton_kernels.loader``
builds it whatever ``TRITON_INTERPRET`` said at import), so these tests need no GPU
and no environment variable. The copy tests use tiles of 64 elements (the ``tiles``
fixture): parameters span several tiles, tiles span several parameters, and the
interpreter's few programs each loop over several tiles. The traced GPU path itself
is checked by tracing on fake CUDA tensors (the kernel is not run).
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

triton_kernels = pytest.importorskip("fsdp_traceable.triton_kernels.ops", reason="triton is not installed")
from fsdp_traceable.triton_kernels import launch, ops, unsharded_views  # noqa: E402
from fsdp_traceable.triton_kernels import layout as layouts  # noqa: E402

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


TILE = 64


@pytest.fixture
def tiles(monkeypatch):
    """Tiles of :data:`TILE` elements (the interpreter runs programs one by one)."""
    monkeypatch.setattr(layouts, "DEFAULT_TILE", TILE)


@pytest.mark.usefixtures("tiles")
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


@pytest.mark.usefixtures("tiles")
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


@pytest.mark.usefixtures("tiles")
def test_all_gather_copy_in_empty_shards_and_padding():
    shards = [torch.arange(10.0), torch.empty(0), torch.arange(3.0).view(3, 1), torch.empty(0)]
    padded = [12, 5, 3, 0]
    actual = torch.ops.fsdp_traceable_triton.all_gather_copy_in(shards, padded, BF16)
    assert_same_bits(actual, torch.ops.fsdp_traceable.all_gather_copy_in(shards, padded, BF16))


@pytest.mark.usefixtures("tiles")
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


@pytest.mark.usefixtures("tiles")
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


@pytest.mark.usefixtures("tiles")
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
    assert -(-flat.numel() // TILE) > launch.INTERPRETER_PROGRAMS  # programs loop over tiles


@pytest.mark.usefixtures("tiles")
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


@pytest.mark.usefixtures("tiles")
def test_casts_round_to_nearest_even_at_every_tie(monkeypatch):
    """Every fp16 and bf16 value widened to fp32, and fp32 values at every fp16 and
    bf16 rounding tie (the midpoints between consecutive finite values, and one fp32
    ulp either side), plus random fp32 bit patterns, narrowed."""
    monkeypatch.setattr(layouts, "DEFAULT_TILE", 2**16)  # few, wide interpreted tiles
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


def test_layouts_and_tile_tables():
    """The per-bucket metadata is built once (same layout object, same device tables),
    and each tile names exactly the parameters whose elements it holds."""
    first = layouts.chunk_layout(((4, 6), (5,), (0,), (9,)), (1, 0, 0, 0), 2, (0,) * 4, 8)
    assert layouts.chunk_layout(((4, 6), (5,), (0,), (9,)), (1, 0, 0, 0), 2, (0,) * 4, 8) is first
    meta, tiles = layouts.device_tables(first, layouts.PACK, torch.device("cpu"))
    again = layouts.device_tables(first, layouts.PACK, torch.device("cpu"))
    assert again[0] is meta and again[1] is tiles
    # (4, 6) Shard(1) at 2 ranks: 4 rows of 3; (5,) Shard(0): ceil(5 / 2) = 3 per rank;
    # (0,): nothing; (9,): 5 per rank. Columns: [0, 12) [12, 15) [15, 20).
    assert first.row_numel == 12 + 3 + 5
    assert meta[:, :4].tolist() == [[0, 12, 3, 24], [12, 3, 3, 5], [15, 0, 1, 0], [15, 5, 5, 9]]
    # Tiles of 8 columns: [0, 8) param 0; [8, 16) params 0 to 3 (2 has no columns);
    # [16, 20) param 3.
    assert tiles.tolist() == [[0, 1], [0, 4], [3, 1]]
    _, out_tiles = layouts.device_tables(first, layouts.UNPACK, torch.device("cpu"))
    # Unsharded buffer: [0, 24) [24, 29) [29, 38).
    assert out_tiles.tolist() == [[0, 1], [0, 1], [0, 1], [1, 3], [3, 1]]


def test_repeated_calls_build_no_metadata(monkeypatch):
    """Eager calls of a bucket seen before reuse its layouts, device tables and pointer
    table: the builders run on the first call only."""
    built = []
    real_tables = layouts.make_tables
    monkeypatch.setattr(layouts, "make_tables", lambda *a: built.append(a[1]) or real_tables(*a))
    params = bucket(2)
    fulls = full_tensors(params, [F32] * len(params))
    shards, padded = rank_shards(params, fulls, 2, 0)
    output = gathered(params, fulls, 2, BF16)
    sizes_flat, ndims, dims = copy_out_args(params, 2)
    layouts.gather_layout.cache_clear()
    layouts.chunk_layout.cache_clear()
    launch._pointer_tables.clear()
    for _ in range(3):
        ops.all_gather_copy_in(shards, padded, BF16)
        ops.reduce_scatter_copy_in(fulls, 2, dims, BF16, 2.0)
        ops.all_gather_copy_out(output, 2, sizes_flat, ndims, dims, [2] * len(params))
    assert layouts.gather_layout.cache_info().misses == 1
    assert layouts.chunk_layout.cache_info().misses == 2  # reduce-scatter and copy-out
    assert sorted(built) == ["pack", "pack", "unpack"]
    assert len(launch._pointer_tables) == 2  # the shards' and the gradients' addresses


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
def test_traced_gpu_path_is_one_op_reading_every_source(op):
    """Traced on GPU, each copy is ONE opaque call of its op (which launches one tile
    kernel), taking every source tensor as an argument, with no constants in the graph."""
    ops_ns = torch.ops.fsdp_traceable_triton
    if op == "all_gather_copy_in":
        graph = _trace_on_fake_cuda(
            lambda a, b, c: ops.all_gather_copy_in([a, b, c], [16, 4, 6], BF16),
            (15,), (3,), (2, 3))
    elif op == "reduce_scatter_copy_in":
        graph = _trace_on_fake_cuda(
            lambda a, b: ops.reduce_scatter_copy_in([a, b], 2, [0, 1], BF16, 3.0), (5, 3), (2, 6))
    else:
        graph = _trace_on_fake_cuda(
            lambda x: ops.all_gather_copy_out(x, 2, [4, 3, 2, 6], [2, 2], [0, 1], [4, 4]), (24,))
    calls = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [getattr(ops_ns, op).default], graph.code
    inputs = [n for n in graph.graph.nodes if n.op == "placeholder"]
    sources = calls[0].args[0]
    assert list(sources) == inputs if isinstance(sources, (list, tuple)) else [sources] == inputs


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


@pytest.mark.usefixtures("tiles", "inductor_cache")
def test_inductor_calls_each_op_once_with_the_eager_bits():
    """Compiled by Inductor (CPU tensors: the op runs the interpreted kernel), each
    copy is one call of its op in the output code, with the eager bits."""
    from torch._inductor.utils import run_and_get_code

    from fsdp_traceable.introspection.inductor_code import schedule

    params = bucket(2)
    fulls = full_tensors(params, [F32] * len(params))
    shards, padded = rank_shards(params, fulls, 2, 1)
    output = gathered(params, fulls, 2, BF16)
    sizes_flat, ndims, dims = copy_out_args(params, 2)

    def copies(shards, output, grads):
        flat = ops.all_gather_copy_out(output, 2, sizes_flat, ndims, dims, [2] * len(params))
        return [ops.all_gather_copy_in(shards, padded, BF16),
                *unsharded_views(flat, sizes_flat, ndims, [BF16] * len(params)),
                ops.reduce_scatter_copy_in(grads, 2, dims, F16, 3.0)]

    torch._dynamo.reset()
    compiled, (code,) = run_and_get_code(torch.compile(copies, fullgraph=True), shards, output, fulls)
    torch._dynamo.reset()
    assert sorted((launch.kind, launch.name) for launch in schedule(code)) == [
        ("extern", f"torch.ops.fsdp_traceable_triton.{op}.default")
        for op in ("all_gather_copy_in", "all_gather_copy_out", "reduce_scatter_copy_in")
    ], code
    for got, want in zip(compiled, copies(shards, output, fulls), strict=True):
        assert_same_bits(got, want, nan_payloads=True)
