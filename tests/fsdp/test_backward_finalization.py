"""FSDP2 2.15's manual backward finalization, ``reset_iter_state`` after a failed
backward and ``set_keep_unsharded_storage`` against torch's FSDP2 on the same model and
seed, bit for bit: one launch of 4 gloo ranks (a 1-D mesh of 4, and HSDP on (2, 2)).
Skipped where this torch's FSDP2 lacks the methods to compare with (before 2.15)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fsdp_traceable.fsdp.backward_finalization import TORCH_HAS_MANUAL_FINALIZATION
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import finalization_cases as cases
from tests.fsdp.feature_cases import assert_bitwise, assert_same_training, case_results, run_cases

pytestmark = [
    pytest.mark.gloo,
    pytest.mark.skipif(not TORCH_HAS_MANUAL_FINALIZATION,
                       reason=f"torch {torch.__version__}'s FSDP2 has no finalize_backward "
                              "to compare with (torch 2.15 on)"),
]

MANUAL_CASES = {
    "sync": (False, False),
    "async": (True, False),
    "async_sync_each": (True, True),
    "hsdp_async": (True, False, True),
}
CASES = [
    *[(f"manual_{name}", cases.manual_accumulation, args) for name, args in MANUAL_CASES.items()],
    ("misuse", cases.misuse_errors, ()),
    ("hsdp_partial", cases.hsdp_partial_reduction_refused, ()),
    ("reset", cases.reset_after_failed_backward, ()),
    ("keep_storage", cases.keep_unsharded_storage, ()),
]


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return run_on_local_ranks(run_cases, 4, CASES, timeout_s=300)


@pytest.mark.parametrize("name", list(MANUAL_CASES))
def test_manual_finalization_trains_like_fsdp2(four_ranks, name: str) -> None:
    for result in case_results(four_ranks, f"manual_{name}"):
        if name == "async_sync_each":
            # Sync on in every backward (not FSDP2's recipe): FSDP2 defers the root
            # group (its forward input, the tokens, needs no gradient, so its
            # post-backward hook never fires) to finalization and reduces the sum of
            # the unsharded gradients; ours reduces each backward's and sums the shards.
            _assert_close_training(result["theirs"], result["ours"])
            continue
        assert_same_training(result["theirs"], result["ours"])
        if MANUAL_CASES[name][0]:  # async: torch's handle class, one per step
            assert result["handles"]["ours"] == ["GradientReductionHandle"] * 2
        # The same all-gathers and reduce-scatters: with sync off, one reduce-scatter
        # per group per step, at finalization.
        assert result["ours"]["counts"] == result["theirs"]["counts"]


def _assert_close_training(theirs: dict[str, Any], ours: dict[str, Any]) -> None:
    assert ours["losses"] == pytest.approx(theirs["losses"], rel=1e-6)
    for a, b in zip(theirs["params"], ours["params"]):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_misuse_raises_fsdp2_errors(four_ranks) -> None:
    for result in case_results(four_ranks, "misuse"):
        assert result["ours"] == result["theirs"]
        assert result["ours"]["finalize_before_forward"] is None
        assert "invalidated" in result["ours"]["wait_after_reset"]
    for result in case_results(four_ranks, "hsdp_partial"):
        assert result["ours"] == result["theirs"] is not None


def test_reset_after_failed_backward_matches_fsdp2(four_ranks) -> None:
    for result in case_results(four_ranks, "reset"):
        theirs, ours = result["theirs"], result["ours"]
        assert ours["grads_none"] == theirs["grads_none"] == [True] * len(ours["grads_none"])
        assert ours["losses"] == theirs["losses"]
        assert_bitwise(theirs["params"], ours["params"], "parameters")


def test_keep_unsharded_storage_matches_fsdp2(four_ranks) -> None:
    for result in case_results(four_ranks, "keep_storage"):
        assert_same_training(result["theirs"], result["ours"])
        assert result["ours"]["same_pointers"] and result["theirs"]["same_pointers"]
