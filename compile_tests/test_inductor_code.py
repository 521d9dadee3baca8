"""Inductor's generated code for a fully_shard-ed transformer's forward and backward:
the order of copies, collectives, overlapping compute and waits, and how many kernels
copy into and out of each collective.

One Inductor compile per configuration (module-scoped, each with its own empty cache),
single process on the fake process group. Kernels are attributed to a collective by
the buffers they touch (:func:`fsdp_traceable.inductor_code.collective_copies`).
"""

from __future__ import annotations

import re
import pytest
import torch
import torch.distributed as dist
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.distributed.fake_pg import FakeStore

from compile_tests.sharded_model import CONFIG, N_GROUPS, data, make_model
from fsdp_traceable.inductor_code import CollectiveCopies, collective_copies
from fsdp_traceable.testing import count_collectives

pytestmark = pytest.mark.slow

# Inductor's passes that move collectives for overlap; off by default, so by default
# every wait follows its collective directly.
OVERLAP_PASSES = dict(
    reorder_for_compute_comm_overlap=True,
    reorder_for_compute_comm_overlap_passes=["sink_waits", "raise_comms",
                                             "reorder_compute_for_overlap"],
)


def _compile_train_step(tmp_dir, **inductor_config) -> tuple[str, str]:
    """Inductor's forward and backward code for one train step of the model."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_dir))
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
        try:
            with torch._inductor.config.patch(force_disable_caches=True, **inductor_config):
                loss_fn = torch.compile(make_model().loss, fullgraph=True)

                def step() -> None:
                    loss_fn(*data()).backward()

                _, codes = run_and_get_code(step)
        finally:
            torch._dynamo.reset()
            dist.destroy_process_group()
    forward, backward = codes
    return forward, backward


@pytest.fixture(scope="module")
def default_code(tmp_path_factory) -> tuple[str, str]:
    return _compile_train_step(tmp_path_factory.mktemp("inductor_default"))


@pytest.fixture(scope="module")
def overlap_code(tmp_path_factory) -> tuple[str, str]:
    return _compile_train_step(tmp_path_factory.mktemp("inductor_overlap"), **OVERLAP_PASSES)


def _by_kind(copies: list[CollectiveCopies], kind: str) -> list[CollectiveCopies]:
    return [c for c in copies if c.kind == kind]


def test_collectives_in_generated_code(default_code: tuple[str, str]) -> None:
    forward, backward = default_code
    assert dict(count_collectives(forward)) == {"all_gather": N_GROUPS, "wait": N_GROUPS}
    # The root keeps its parameters from forward; the blocks are gathered again.
    assert dict(count_collectives(backward)) == {
        "all_gather": CONFIG.n_layers, "reduce_scatter": N_GROUPS,
        "wait": CONFIG.n_layers + N_GROUPS,
    }


def test_copy_in_and_reduce_scatter_copy_in_are_one_kernel_per_group(
    default_code: tuple[str, str],
) -> None:
    forward, backward = (collective_copies(code) for code in default_code)
    assert len(forward) == N_GROUPS and len(backward) == CONFIG.n_layers + N_GROUPS
    # Each group's copy-in is written by one kernel. In forward that kernel is the same
    # for the three groups: their copy-ins read only the sharded parameters, so
    # Inductor fuses them all into the first kernel.
    for gather in _by_kind(forward, "all_gather") + _by_kind(backward, "all_gather"):
        assert len(gather.copy_in) == 1, gather
    assert len({gather.copy_in[0] for gather in _by_kind(forward, "all_gather")}) == 1
    # Each group's gradients are packed for the reduce-scatter by one kernel, fused
    # with the computation of the group's last gradients.
    for scatter in _by_kind(backward, "reduce_scatter"):
        assert len(scatter.copy_in) == 1, scatter
        assert "_chunk_cat" in scatter.copy_in[0]


def test_copy_out_kernels_per_group(default_code: tuple[str, str]) -> None:
    forward, backward = (collective_copies(code) for code in default_code)
    # Copy-out is one kernel for the root group only. For a block, Inductor splits the
    # split_with_sizes_copy into one copy per parameter and fuses each into the
    # kernel that first uses that parameter, or leaves it alone before its matmul:
    # 7 kernels for the 9 parameters in forward, 9 in backward. (Copy-out as a single
    # cat into one buffer, parameters as views of it, measured one kernel per group,
    # but Inductor then split the reduce-scatter copy-in into up to 8 kernels.)
    assert [len(g.copy_out) for g in _by_kind(forward, "all_gather")] == [1, 7, 7]
    assert [len(g.copy_out) for g in _by_kind(backward, "all_gather")] == [9, 9]
    # The reduce-scatter outputs are the sharded gradients themselves (views, no copy).
    assert [len(s.copy_out) for s in _by_kind(backward, "reduce_scatter")] == [0, 0, 0]


@pytest.mark.xfail(strict=True, reason="Inductor splits a block's copy-out per parameter")
def test_copy_out_is_one_kernel_per_group(default_code: tuple[str, str]) -> None:
    for code in default_code:
        for gather in _by_kind(collective_copies(code), "all_gather"):
            assert len(gather.copy_out) == 1, gather


def _alias_names(code: str, buffer: str) -> str:
    """A regex matching ``buffer`` or any alias Inductor declares for it."""
    buffer = buffer.split("#")[0]  # drop collective_copies' reuse marker
    names = [buffer] + re.findall(rf"(buf\d+) = reinterpret_tensor\({buffer},.*# alias", code)
    return "(" + "|".join(names) + r")\b"


def _check_overlapped(code: str, collective: CollectiveCopies) -> None:
    """Copy-in kernel, the collective, a matmul, its wait, then the copy-out kernel."""
    src, out = collective.input_buffer, collective.output_buffer.split("#")[0]
    check = (
        FileCheck()
        .check_regex(rf"cpp_fused_\w+\(.*\b{_alias_names(code, src)}")
        .check(f"{out} = torch.ops._c10d_functional.{collective.op}.default(")
        .check("extern_kernels.mm(")
        .check(f"torch.ops._c10d_functional.wait_tensor.default({out})")
    )
    if collective.copy_out:
        check = check.check_regex(rf"{collective.copy_out[0]}\(.*\b{out}\b")
    check.run(code)


def test_overlap_order_with_inductor_overlap_passes(overlap_code: tuple[str, str]) -> None:
    forward, backward = overlap_code
    forward_copies, backward_copies = collective_copies(forward), collective_copies(backward)
    # With the passes on, a block's all-gather is issued before compute it does not
    # depend on and waited for only when needed: in forward, block 1's all-gather runs
    # during block 0's matmuls; in backward, each block's re-gather runs during the
    # matmuls of the backward before it.
    _check_overlapped(forward, _by_kind(forward_copies, "all_gather")[-1])
    for gather in _by_kind(backward_copies, "all_gather"):
        _check_overlapped(backward, gather)
    # Gradients are packed for the reduce-scatter by a kernel before it.
    for scatter in _by_kind(backward_copies, "reduce_scatter"):
        FileCheck().check_regex(
            rf"{re.escape(scatter.copy_in[-1])}\(.*\b{_alias_names(backward, scatter.input_buffer)}"
        ).check(f"{scatter.output_buffer} = torch.ops._c10d_functional.reduce_scatter_tensor"
                ).run(backward)


def test_default_schedule_waits_right_after_each_all_gather(default_code: tuple[str, str]) -> None:
    # Without the overlap passes nothing runs between an all-gather and its wait: the
    # traced graph waits inside each group's forward, and Inductor keeps that order.
    for code in default_code:
        for gather in _by_kind(collective_copies(code), "all_gather"):
            FileCheck().check(
                f"{gather.output_buffer} = torch.ops._c10d_functional.all_gather_into_tensor"
            ).check_not("cpp_fused_").check_not("extern_kernels.").check(
                f"wait_tensor.default({gather.output_buffer})"
            ).run(code)
