"""``fsdp_traceable.testing`` and the Inductor-code reader on small functions with
known graph breaks, recompiles and collectives."""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.fx.experimental.proxy_tensor import make_fx

from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.introspection.inductor_code import collective_copies, collective_kind
from fsdp_traceable.testing import (
    assert_no_recompiles,
    count_collectives,
    count_graph_breaks,
    track_compiles,
)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _with_one_break(x: torch.Tensor) -> torch.Tensor:
    y = x.sin()
    torch._dynamo.graph_break()
    return y.cos()


def test_count_graph_breaks_finds_the_break_and_its_line() -> None:
    count, reasons = count_graph_breaks(torch.compile(_with_one_break, backend="eager"),
                                        torch.randn(3))
    assert count == 1 and len(reasons) == 1
    breaks = count_graph_breaks(torch.compile(_with_one_break, backend="eager"), torch.randn(3))
    assert breaks.count == 0  # compiled already: no new break on the second call
    torch._dynamo.reset()
    breaks = count_graph_breaks(torch.compile(_with_one_break, backend="eager"), torch.randn(3))
    assert "graph_break" in breaks.summaries()[0]
    line = _with_one_break.__code__.co_firstlineno + 2
    assert breaks.locations == [f"{__file__}:{line}"]


def test_count_graph_breaks_is_zero_without_a_break() -> None:
    breaks = count_graph_breaks(torch.compile(lambda x: x.sin().cos(), backend="eager"),
                                torch.randn(3))
    assert (breaks.count, breaks.reasons) == (0, [])


def test_assert_no_recompiles_passes_on_first_compiles_and_cache_hits() -> None:
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    with assert_no_recompiles() as record:
        for _ in range(3):
            f(torch.randn(4))
    assert [frame.is_recompile for frame in record.frames] == [False]


def test_assert_no_recompiles_reports_the_reason() -> None:
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    f(torch.randn(4))
    with pytest.raises(AssertionError, match="size mismatch at index 0. expected 4, actual 5"):
        with assert_no_recompiles():
            f(torch.randn(5))


def test_track_compiles_counts_compiled_autograd_recaptures() -> None:
    model = torch.nn.Linear(3, 2)
    compiler = torch.compile(backend="eager")

    def step() -> None:
        with torch._dynamo.compiled_autograd._enable(compiler):
            model(torch.randn(4, 3)).sum().backward()

    with track_compiles() as record:
        step()  # .grad is None: assigned
        step()  # .grad exists: accumulated, a second graph
        step()  # cache hit
    assert record.compiled_autograd_captures == 2
    # Graphs were captured before: a new one (another autograd graph) is a recompile.
    other = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    with pytest.raises(AssertionError) as failure:
        with assert_no_recompiles():
            with torch._dynamo.compiled_autograd._enable(compiler):
                other(torch.randn(4, 3)).sum().backward()
    assert "compiled autograd captured 1 backward graph(s); expected at most 0" in str(failure.value)
    with assert_no_recompiles():
        step()  # cache hits only
    torch._dynamo.compiled_autograd.reset()
    model.zero_grad()
    with assert_no_recompiles(max_compiled_autograd_captures=2):
        step()
        step()


def test_count_collectives_in_a_traced_graph() -> None:
    with fake_process_group(2, reset_dynamo=False):
        group_name = funcol._resolve_group_name(dist.group.WORLD)

        def fn(x: torch.Tensor) -> torch.Tensor:
            gathered = torch.ops._c10d_functional.all_gather_into_tensor(x, 2, group_name)
            reduced = torch.ops._c10d_functional.reduce_scatter_tensor(
                funcol.wait_tensor(gathered), "sum", 2, group_name)
            return funcol.wait_tensor(reduced) + funcol.wait_tensor(
                torch.ops._c10d_functional.all_reduce(x, "sum", group_name))

        gm = make_fx(fn)(torch.randn(4))
    assert count_collectives(gm) == Counter(all_gather=1, reduce_scatter=1, all_reduce=1, wait=3)
    assert count_collectives(gm.graph) == count_collectives(gm)


# The shape of Inductor's wrapper code: a copy-in kernel writing an all-gather input
# through aliases, an unrelated kernel, the collective and its wait, two copy-out
# kernels and a matmul reading the output, then a buffer reused under a new name and
# an inline reinterpret_tensor input to a reduce-scatter.
_CODE = textwrap.dedent("""\
    def call(self, args):
        buf4 = empty_strided_cpu((8, ), (1, ), torch.float32)
        buf0 = reinterpret_tensor(buf4, (4, ), (1, ), 0)  # alias
        buf1 = reinterpret_tensor(buf4, (4, ), (1, ), 4)  # alias
        # Topologically Sorted Source Nodes: [cat, all_gather_into_tensor]
        cpp_fused_cat_0(primals_1, primals_2, buf0, buf1)
        cpp_fused_other_1(primals_3, buf9)
        buf5 = torch.ops._c10d_functional.all_gather_into_tensor.default(buf4, 2, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf5)
        cpp_fused_copy_2(buf5, buf6)
        extern_kernels.mm(reinterpret_tensor(buf5, (4, 4), (4, 1), 0), buf6, out=buf7)
        cpp_fused_copy_3(buf5, buf8)
        buf10 = buf4; del buf4  # reuse
        cpp_fused__chunk_cat_4(buf7, buf10)
        buf11 = torch.ops._c10d_functional.reduce_scatter_tensor.default(reinterpret_tensor(buf10, (8, ), (1, ), 0), 'avg', 2, '0')
        torch.ops._c10d_functional.wait_tensor.default(buf11)
        return (buf11, )
    runner = Runner(partitions=[])
    """)  # noqa: E501  (Inductor output code as printed)


def test_collective_copies_attributes_kernels_by_buffer() -> None:
    gather, scatter = collective_copies(_CODE)
    assert (gather.kind, gather.input_buffer, gather.output_buffer) == ("all_gather", "buf4", "buf5")
    assert gather.copy_in == ["cpp_fused_cat_0"]
    assert gather.copy_out == ["cpp_fused_copy_2", "cpp_fused_copy_3"]
    assert scatter.kind == "reduce_scatter"
    # buf10 reuses buf4's memory: a new buffer, so its writer is not the gather's copy-in.
    assert scatter.copy_in == ["cpp_fused__chunk_cat_4"]
    assert scatter.waited and scatter.copy_out == []
    assert count_collectives(_CODE) == Counter(all_gather=1, reduce_scatter=1, wait=2)


def test_collective_kind_names() -> None:
    assert collective_kind("_c10d_functional.all_gather_into_tensor_out.default") == "all_gather"
    assert collective_kind("reduce_scatter_tensor_coalesced") == "reduce_scatter"
    assert collective_kind("_c10d_functional.wait_tensor.default") == "wait"
    assert collective_kind("aten.cat.default") is None


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="fn must be callable"):
        count_graph_breaks(3)
    with pytest.raises(TypeError, match="graph_or_code must be"):
        count_collectives(3)
    with pytest.raises(ValueError, match="max_compiled_autograd_captures"):
        with assert_no_recompiles(max_compiled_autograd_captures=-1):
            pass
