"""Inductor's generated code for a fully_shard-ed transformer's forward and backward:
the order of copies, collectives, overlapping compute and waits, and how many kernels
copy into and out of each collective, with Inductor's defaults and with
:func:`fsdp_traceable.inductor_options` (AOTAutograd's backward and compiled autograd);
and the compute between each collective and its wait in the whole step as one graph
(:func:`fsdp_traceable.compile_step`).

One Inductor compile per configuration (module-scoped; graph caches off, kernels shared),
single process on the fake process group. Kernels are attributed to a collective by
the buffers they touch (:func:`fsdp_traceable.inductor_code.collective_copies`).
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck

import fsdp_traceable
from compile_tests.sharded_model import CONFIG, N_GROUPS, data, make_model
from fsdp_traceable.introspection.fake_world import fake_process_group
from fsdp_traceable.introspection.inductor_code import CollectiveCopies, collective_copies, overlap
from fsdp_traceable.testing import count_collectives
from fsdp_traceable.tracing import regions_available
from fsdp_traceable.whole_step import dynamo_traces_backward_into_dtensors
from fsdp_traceable.whole_step.inductor_options import inductor_options
from tests.fixtures import kernel_cache_only

pytestmark = pytest.mark.slow



def _compile_train_step(cache_dir, options: dict, compiled_autograd: bool = False) -> tuple[str, str]:
    """Inductor's forward and backward code for one train step of the model."""
    with kernel_cache_only(cache_dir):
        with fake_process_group(2):
            loss_fn = torch.compile(make_model().loss, fullgraph=True, options=options)
            backward_context = (
                torch._dynamo.compiled_autograd._enable(torch.compile(options=options))
                if compiled_autograd else contextlib.nullcontext()
            )

            def step() -> None:
                loss = loss_fn(*data())
                with backward_context:
                    loss.backward()

            _, codes = run_and_get_code(step)
    forward, backward = codes
    return forward, backward


@pytest.fixture(scope="module")
def default_code(run_inductor_cache_dir) -> tuple[str, str]:
    return _compile_train_step(run_inductor_cache_dir, {})


@pytest.fixture(scope="module")
def grouped_code(run_inductor_cache_dir) -> tuple[str, str]:
    return _compile_train_step(
        run_inductor_cache_dir, inductor_options(overlap=False)
    )


@pytest.fixture(scope="module")
def grouped_compiled_autograd_code(run_inductor_cache_dir) -> tuple[str, str]:
    return _compile_train_step(
        run_inductor_cache_dir, inductor_options(overlap=False),
        compiled_autograd=True,
    )


@pytest.fixture(scope="module")
def options_code(run_inductor_cache_dir) -> tuple[str, str]:
    return _compile_train_step(run_inductor_cache_dir, inductor_options())


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


def _assert_one_kernel_per_group(copies: list[CollectiveCopies], reduce_scatter_copy_in: bool) -> None:
    for gather in _by_kind(copies, "all_gather"):
        assert (len(gather.copy_in), len(gather.copy_out)) == (1, 1), gather
    for scatter in _by_kind(copies, "reduce_scatter"):
        # The reduce-scatter outputs are the sharded gradients themselves (views, no copy).
        assert not scatter.copy_out, scatter
        if reduce_scatter_copy_in:
            assert len(scatter.copy_in) == 1, scatter


def test_copy_in_and_copy_out_are_one_kernel_per_group_by_default(
    default_code: tuple[str, str],
) -> None:
    forward, backward = (collective_copies(code) for code in default_code)
    assert len(forward) == N_GROUPS and len(backward) == CONFIG.n_layers + N_GROUPS
    for copies in (forward, backward):
        _assert_one_kernel_per_group(copies, reduce_scatter_copy_in=False)


def test_default_peak_memory_order_copies_each_gradient_after_its_kernel(
    default_code: tuple[str, str],
) -> None:
    # Inductor's peak-memory reordering moves gradient copies into the reduce-scatter
    # input up to the kernels computing those gradients, so each gradient is freed at
    # once. How many kernels a group's packing ends up in follows the schedule: 8 for
    # the last block (backward's first), 3 for block 0, 2 for the root.
    backward = collective_copies(default_code[1])
    assert [len(s.copy_in) for s in _by_kind(backward, "reduce_scatter")] == [8, 3, 2]


def test_grouped_copy_kernels_make_every_copy_one_kernel_per_group(
    grouped_code: tuple[str, str], grouped_compiled_autograd_code: tuple[str, str],
) -> None:
    # inductor_options(overlap=False): with peak-memory reordering off, each group's
    # gradients are packed by one kernel, with AOTAutograd's backward and compiled
    # autograd alike.
    for code in (*grouped_code, *grouped_compiled_autograd_code):
        _assert_one_kernel_per_group(collective_copies(code), reduce_scatter_copy_in=True)
    for scatter in _by_kind(collective_copies(grouped_code[1]), "reduce_scatter"):
        assert "_chunk_cat" in scatter.copy_in[0]


def test_overlap_passes_split_a_block_reduce_scatter_copy_in_in_two(
    options_code: tuple[str, str],
) -> None:
    # With the overlap passes on as well, Inductor's reordering places the copies of a
    # block's attention gradients in an earlier kernel than those of its MLP and norm
    # gradients: two kernels per block, one for the root. Copy-in and copy-out stay one.
    forward, backward = (collective_copies(code) for code in options_code)
    _assert_one_kernel_per_group(forward, reduce_scatter_copy_in=False)
    _assert_one_kernel_per_group(backward, reduce_scatter_copy_in=False)
    assert [len(s.copy_in) for s in _by_kind(backward, "reduce_scatter")] == [2, 2, 1]


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


def test_overlap_order_with_inductor_options(options_code: tuple[str, str]) -> None:
    forward, backward = options_code
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
    # Without Inductor's overlap passes nothing runs between an all-gather and its wait: the
    # traced graph waits inside each group's forward, and Inductor keeps that order.
    for code in default_code:
        for gather in _by_kind(collective_copies(code), "all_gather"):
            FileCheck().check(
                f"{gather.output_buffer} = torch.ops._c10d_functional.all_gather_into_tensor"
            ).check_not("cpp_fused_").check_not("extern_kernels.").check(
                f"wait_tensor.default({gather.output_buffer})"
            ).run(code)


def _compile_whole_step(cache_dir, forward_regions: bool) -> str:
    """Inductor's code for the whole step, with ``inductor_options(raise_collectives=False)``."""
    if not dynamo_traces_backward_into_dtensors():
        pytest.skip("this torch's Dynamo cannot trace backward() into DTensor parameters")
    if forward_regions and not regions_available():
        pytest.skip("this torch's nested_compile_region takes no reuse key")
    with (kernel_cache_only(cache_dir), fake_process_group(2),
          fsdp_traceable.config.patch(forward_regions=forward_regions)):
        model = make_model()

        def step(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = model.loss(tokens, targets)
            loss.backward()
            return loss.detach()

        options = inductor_options(raise_collectives=False)
        _, codes = run_and_get_code(fsdp_traceable.compile_step(step, options=options), *data())
    (code,) = codes
    return code


@pytest.fixture(scope="module")
def whole_step_code(run_inductor_cache_dir) -> str:
    return _compile_whole_step(run_inductor_cache_dir, forward_regions=False)


@pytest.fixture(scope="module")
def whole_step_regions_code(run_inductor_cache_dir) -> str:
    return _compile_whole_step(run_inductor_cache_dir, forward_regions=True)


def test_whole_step_waits_for_each_collective_where_its_result_is_needed(
        whole_step_code: str) -> None:
    overlaps = overlap(whole_step_code)
    # In program order: the root's, block 0's and block 1's all-gathers; block 1's
    # re-gather, its reduce-scatter; block 0's re-gather, its and the root's
    # reduce-scatters (the root keeps its parameters). Each is issued where the program
    # issues it (none before the forward that precedes it: a re-gather stays in backward)
    # and waited for where its output is first read: block 1's all-gather runs during
    # block 0's compute, its re-gather during the loss and output layer's backward, its
    # reduce-scatter during block 0's backward. Block 0's re-gather is needed at once; the
    # root's reduce-scatter is the step's last collective.
    assert [(o.kind, bool(o.compute)) for o in overlaps] == [
        ("all_gather", True), ("all_gather", True), ("all_gather", True), ("all_gather", True),
        ("reduce_scatter", True), ("all_gather", False), ("reduce_scatter", True),
        ("reduce_scatter", False),
    ]
    assert all(o.waited for o in overlaps)
    block_1_gather, block_1_regather = overlaps[2], overlaps[3]
    assert len(block_1_gather.compute) >= 5 and len(block_1_regather.compute) >= 10
    assert block_1_regather.line > block_1_gather.wait_line


def test_whole_step_with_forward_regions_overlaps_each_block_with_the_previous(
        whole_step_regions_code: str) -> None:
    # Each block's forward and backward is one call of a compiled region. The region
    # schedule moves block 1's all-gather before block 0's forward region, block 0's
    # re-gather before block 1's backward region and block 1's reduce-scatter wait after
    # block 0's backward region: every all-gather overlaps compute, block 0's re-gather
    # included (it does not without regions); the last two reduce-scatters have nothing
    # after them to overlap.
    # Each block's copy-out is one call of a compiled region too, named before the
    # forward region (see [Note: copy regions]).
    code = whole_step_regions_code
    (forward,) = set(re.findall(r"= (partitioned_fw_subgraph_\d+_0)\(", code))
    backward = forward.replace("_fw_", "_bw_")
    assert len(re.findall(rf"= {forward}\(", code)) == CONFIG.n_layers
    assert len(re.findall(rf"= {backward}\(", code)) == CONFIG.n_layers
    assert [(o.kind, bool(o.compute)) for o in overlap(code)] == [
        ("all_gather", True), ("all_gather", True), ("all_gather", True), ("all_gather", True),
        ("all_gather", True), ("reduce_scatter", True), ("reduce_scatter", False),
        ("reduce_scatter", False),
    ]
    block_1_gather, block_0_regather, block_1_reduce = (overlap(code)[i] for i in (2, 4, 5))
    assert forward in block_1_gather.compute
    assert backward in block_0_regather.compute
    assert backward in block_1_reduce.compute
