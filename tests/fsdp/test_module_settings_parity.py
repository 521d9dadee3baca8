"""``FSDPModule``'s reduction and prefetch setters against torch's FSDP2, eager, bitwise:
2 gloo ranks, and HSDP on a (2, 2) mesh of 4; compiled behaviour of each is in
``compile_tests/test_module_settings_compile.py``."""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import settings_cases
from tests.fsdp.feature_cases import assert_bitwise, case_results, run_cases

TWO_RANK_CASES = [
    ("divide_shard_size", settings_cases.divide_factor, ("shard_size",)),
    ("divide_custom_sum", settings_cases.divide_factor, ("custom_sum",)),
    ("deprecated_divide", settings_cases.deprecated_divide_factor, ()),
    ("force_sum", settings_cases.force_sum, ()),
    ("unshard_async_op", settings_cases.unshard_async_op, ()),
    ("unused_reduced", settings_cases.unused_params_reduced, ()),
    ("all_reduce_hook", settings_cases.all_reduce_hook, (False,)),
    ("explicit_prefetch", settings_cases.explicit_prefetch, ()),
    ("unshard_in_backward", settings_cases.unshard_in_backward_off, ()),
    ("custom_comms", settings_cases.custom_comms, ()),
    ("process_group_allocation", settings_cases.process_group_allocation, ()),
]
FOUR_RANK_CASES = [
    ("hsdp_skip_all_reduce", settings_cases.hsdp_all_reduce_every_other, ()),
    ("hsdp_all_reduce_hook", settings_cases.all_reduce_hook, (True,)),
]


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_on_local_ranks(run_cases, 2, TWO_RANK_CASES, timeout_s=600)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_local_ranks(run_cases, 4, FOUR_RANK_CASES, timeout_s=600)



def _assert_same_training(result: dict[str, Any]) -> None:
    theirs, ours = result["theirs"], result["ours"]
    assert ours["losses"] == theirs["losses"]
    assert_bitwise(theirs["grads"], ours["grads"], "first-step gradients")
    assert_bitwise(theirs["params"], ours["params"], "parameters")


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["divide_shard_size", "divide_custom_sum", "force_sum",
                                  "unshard_async_op",
                                  "unused_reduced", "all_reduce_hook", "explicit_prefetch",
                                  "unshard_in_backward", "custom_comms",
                                  "process_group_allocation"])
def test_two_ranks_train_like_fsdp2(two_ranks, name: str) -> None:
    for result in case_results(two_ranks, name):
        _assert_same_training(result)


@pytest.mark.gloo
def test_settings_have_their_effect(two_ranks) -> None:
    for result in case_results(two_ranks, "unused_reduced"):
        # the unused layer's weight and bias: zero gradients, not None
        assert [g is None for g in result["ours"]["grads"][-2:]] == [False, False]
        assert all(not g.any() for g in result["ours"]["grads"][-2:])
    for result in case_results(two_ranks, "all_reduce_hook"):
        assert result["calls"]["ours"] == result["calls"]["theirs"] > 0
    for result in case_results(two_ranks, "explicit_prefetch"):
        # inside block 0's forward, blocks 1 and 2 are in flight, block 3 is not
        assert result["in_flight"] == [[True, True, False]] * 2
        assert result["ours"]["reduce_scatters"] == result["theirs"]["reduce_scatters"]
    for result in case_results(two_ranks, "unshard_in_backward"):
        assert result["ours"]["all_gathers"] == result["theirs"]["all_gathers"]
        assert "set_unshard_in_backward(False)" in result["block_error"]
    for result in case_results(two_ranks, "custom_comms"):
        counts = result["ours"]["counts"]
        # every all-gather of ours went through the custom comm (and FSDP2's too)
        assert counts["all_gather_calls"] == counts["c10d_all_gathers"] > 0
        assert result["theirs"]["counts"]["all_gather_calls"] > 0
        # FSDP2 allocates input and output per reduce-scatter, as ours does
        assert counts["reduce_scatter_calls"] == result["theirs"]["counts"]["reduce_scatter_calls"]
        assert counts["reduce_scatter_allocations"] == 2 * counts["reduce_scatter_calls"]
    for result in case_results(two_ranks, "process_group_allocation"):
        # FSDP2's symmetric-memory comm, built by both libraries, refuses a CPU machine
        assert result["ours"]["symm_mem_error"] == result["theirs"]["symm_mem_error"]
        assert result["ours"]["symm_mem_error"].startswith("RuntimeError")
    for result in case_results(two_ranks, "deprecated_divide"):
        assert result["warnings"]["ours"] == result["warnings"]["theirs"] == ["DeprecationWarning"]
        assert result["factor"] == 2.0


@pytest.mark.gloo
@pytest.mark.parametrize("name", ["hsdp_skip_all_reduce", "hsdp_all_reduce_hook"])
def test_hsdp_trains_like_fsdp2(four_ranks, name: str) -> None:
    for result in case_results(four_ranks, name):
        _assert_same_training(result)
    if name == "hsdp_skip_all_reduce":
        for result in case_results(four_ranks, name):
            # 3 groups x 2 steps, once per step (the first microbatch skips it)
            assert result["ours"]["all_reduces"] == result["theirs"]["all_reduces"] == 6
    if name == "hsdp_all_reduce_hook":
        for result in case_results(four_ranks, name):
            assert result["calls"]["ours"] == result["calls"]["theirs"] > 0
