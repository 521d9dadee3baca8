"""The foreach collectives under ``torch.compile(fullgraph=True)``: one graph, no graph
break, and one fused Inductor kernel per copy.

Single process on the fake process group (its collective data are meaningless, so these
tests check structure; the numbers are checked on real gloo ranks in ``tests/``).
Inductor's generated code is read back with ``run_and_get_code``; C++ kernel launches
are attributed to the copy-in or copy-out by their position relative to the
collectives in Inductor's ``call`` function.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator

import expecttest
import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

import fsdp_traceable as ft
from fsdp_traceable.introspection.fake_world import fake_process_group

BUCKET_SIZE = 32
# Graph nodes that compute nothing: list indexing and no_grad's grad-mode switches.
_BOOKKEEPING_CALLS = (operator.getitem, torch._C._set_grad_enabled)

_KERNEL_CALL = re.compile(r"^\s*(cpp_fused_\w+)\(")
_KERNEL_DEF = re.compile(r"^(cpp_fused_\w+) = async_compile\.cpp", re.MULTILINE)
_COLLECTIVE_CALL = re.compile(r"torch\.ops\._c10d_functional\.(\w+)\.default\(")
# An aten op run as a fallback (or an extern kernel) would be a copy Inductor did not fuse.
_FALLBACK_CALL = re.compile(r"^\s*[^\s#].*\b(aten\.|extern_kernels\.)")


@pytest.fixture
def fresh_compile(inductor_cache) -> Iterator[None]:
    """Graph caches off and Dynamo state reset: kernel counts must come from this
    compile's code, not from code cached by an earlier test or run."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.fixture
def fake_group(request) -> Iterator[dist.ProcessGroup]:
    """Rank 0 of a fake process group of ``request.param`` ranks."""
    with fake_process_group(request.param, reset_dynamo=False):
        yield dist.group.WORLD


def bucket_specs(world_size: int, with_shard1: bool = True) -> list[tuple[tuple[int, ...], int]]:
    """32 ``(global size, shard dim)`` pairs: vectors, matrices whose dim 0 does not
    divide by ``world_size`` (padded shards) and, ``with_shard1``, a few ``Shard(1)``
    matrices."""
    specs = []
    for i in range(BUCKET_SIZE):
        if i % 3 == 0:
            specs.append(((65 + i,), 0))
        elif i % 8 == 1 and with_shard1:
            specs.append(((24 + i, 8 * world_size), 1))
        else:
            specs.append(((37 + 3 * i, 16 + i % 5), 0))
    return specs


def make_infos(
    world_size: int, with_shard1: bool = True, **dtypes: torch.dtype
) -> list[ft.ShardInfo]:
    infos = [
        ft.make_shard_info(size, world_size, 0, shard_dim=dim, **dtypes)
        for size, dim in bucket_specs(world_size, with_shard1)
    ]
    assert any(i.global_size[0] % world_size for i in infos if i.shard_dim == 0)
    return infos


def kernel_schedule(code: str) -> list[str]:
    """Inductor's ``call`` body as a sequence of ``"kernel"`` and collective op names."""
    events = []
    for line in code[code.index("def call(") :].splitlines():
        if _KERNEL_CALL.match(line):
            events.append("kernel")
        elif match := _COLLECTIVE_CALL.search(line):
            events.append(match.group(1))
        elif _FALLBACK_CALL.match(line):
            events.append("fallback: " + line.strip())
    return events


def kernels_around(events: list[str], collective: str) -> tuple[int, int]:
    """Kernel launches before ``collective`` and after the last ``wait_tensor``."""
    start = events.index(collective)
    last_wait = max(i for i, event in enumerate(events) if event == "wait_tensor")
    assert last_wait > start, events
    return events[:start].count("kernel"), events[last_wait + 1 :].count("kernel")


def compile_and_get_code(fn, *args) -> str:
    """Compiles ``fn`` with Inductor, runs it once, checks it made exactly one graph
    without a graph break, and returns the generated code."""
    counter = CompileCounterWithBackend("inductor")
    _, codes = run_and_get_code(torch.compile(fn, backend=counter, fullgraph=True), *args)
    assert counter.frame_count == 1 and len(counter.graphs) == 1
    assert not counters["graph_break"], dict(counters["graph_break"])
    return "\n".join(codes)


@pytest.mark.slow
@pytest.mark.parametrize(
    "fake_group, with_shard1",
    # All Shard(0) (copy-out through split_with_sizes_copy) and with Shard(1) members
    # (the per-parameter copy-out): both must fuse.
    [(2, False), (4, True)],
    indirect=["fake_group"],
    ids=["shard0-world2", "with-shard1-world4"],
)
def test_all_gather_bucket_fuses_copy_in_and_copy_out_into_one_kernel_each(
    fresh_compile, fake_group, with_shard1
):
    world_size = fake_group.size()
    infos = make_infos(world_size, with_shard1, param_dtype=torch.bfloat16)
    shards = [torch.randn(info.sharded_size) for info in infos]

    def all_gather(shards):
        return ft.foreach_all_gather_copy_out(ft.foreach_all_gather(shards, infos, fake_group))

    code = compile_and_get_code(all_gather, shards)
    events = kernel_schedule(code)
    assert not [e for e in events if e.startswith("fallback")], events
    assert events.count("all_gather_into_tensor") == 1, events
    assert kernels_around(events, "all_gather_into_tensor") == (1, 1), events
    assert len(set(_KERNEL_DEF.findall(code))) == 2, code


@pytest.mark.slow
@pytest.mark.parametrize(
    "fake_group, dtypes, view_out_kernels",
    [
        # bf16 gradients reduced in fp32 into fp32 parameters: the cast is fused into
        # the copy-in; the compiled view-out is views of the reduce-scatter output.
        (2, dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32), 0),
        # fp16 reduction: pre-divide fused into the copy-in, post-divide and the cast
        # back to fp32 fused into one view-out kernel.
        (4, dict(param_dtype=torch.float16), 1),
    ],
    indirect=["fake_group"],
    ids=["bf16-reduce-fp32-world2", "fp16-prepost-divide-world4"],
)
def test_reduce_bucket_fuses_reduce_scatter_copy_in_into_one_kernel(
    fresh_compile, fake_group, dtypes, view_out_kernels
):
    world_size = fake_group.size()
    infos = make_infos(world_size, **dtypes)
    grads = [torch.randn(info.global_size, dtype=info.param_dtype) for info in infos]
    schedule = ft.gradient_divide_schedule(world_size, 1, infos[0].reduce_dtype)
    assert (schedule.predivide_factor is not None) == (view_out_kernels == 1)

    def reduce(grads):
        return ft.foreach_reduce(grads, infos, fake_group).sharded_grads

    code = compile_and_get_code(reduce, grads)
    events = kernel_schedule(code)
    assert not [e for e in events if e.startswith("fallback")], events
    assert events.count("reduce_scatter_tensor") == 1, events
    assert kernels_around(events, "reduce_scatter_tensor") == (1, view_out_kernels), events


def graph_summary(gm: torch.fx.GraphModule) -> str:
    """One line per computing call of a Dynamo graph: the op (``namespace.name`` for
    torch ops, the function name otherwise) and its outputs' dtypes and sizes."""
    lines = []
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in _BOOKKEEPING_CALLS:
            continue
        if isinstance(node.target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            name = str(node.target).removesuffix(".default")
        else:
            name = node.target.__name__
        value = node.meta["example_value"]
        values = value if isinstance(value, (list, tuple)) else [value]
        outs = ", ".join(f"{str(v.dtype).removeprefix('torch.')}{list(v.shape)}" for v in values)
        lines.append(f"{name} -> {outs}")
    return "\n".join(lines)


@pytest.mark.parametrize("fake_group", [2], indirect=True)
def test_dynamo_graph_of_two_parameter_bucket(fresh_compile, fake_group):
    infos = [
        ft.make_shard_info(size, 2, 0, param_dtype=torch.bfloat16) for size in [(3, 4), (5,)]
    ]
    shards = [torch.randn(info.sharded_size) for info in infos]
    grads = [torch.randn(info.global_size, dtype=torch.bfloat16) for info in infos]

    def step(shards, grads):
        in_flight = ft.foreach_all_gather(shards, infos, fake_group)
        # Compute issued while the all-gather is in flight stays before its wait.
        overlapped = shards[0] * 2
        unsharded = ft.foreach_all_gather_copy_out(in_flight)
        return unsharded, overlapped, ft.foreach_reduce(grads, infos, fake_group).sharded_grads

    counter = CompileCounterWithBackend("eager")
    torch.compile(step, backend=counter, fullgraph=True)(shards, grads)
    assert counter.frame_count == 1 and not counters["graph_break"]
    expecttest.assert_expected_inline(
        graph_summary(counter.graphs[0]),
        """\
fsdp_traceable.all_gather_copy_in -> bfloat16[11]
_c10d_functional.all_gather_into_tensor -> bfloat16[22]
mul -> float32[2, 4]
_c10d_functional.wait_tensor -> bfloat16[22]
fsdp_traceable.all_gather_copy_out -> bfloat16[3, 4], bfloat16[5]
fsdp_traceable.reduce_scatter_copy_in -> bfloat16[22]
_c10d_functional.reduce_scatter_tensor -> bfloat16[11]
_c10d_functional.wait_tensor -> bfloat16[11]
fsdp_traceable.reduce_scatter_view_out -> float32[2, 4], float32[3]""",
    )
