"""No data loss across checkpoints, and determinism, on real gloo ranks.

A 2-rank run trains 5 AdamW steps, saving a DCP checkpoint (parameters and optimizer
state) after step 2. Fresh runs (other seeds, new processes) load it: at 2 ranks the
parameters and optimizer state come back bit for bit and training resumed from it
follows the uninterrupted run's losses and ends at its parameters bit for bit; at 4
ranks it loads bit for bit too, and a 4-rank checkpoint loads at 2 ranks bit for bit.
A second 2-rank run from the same seed, in new processes, repeats the losses bit for
bit. (Compiled training against FSDP2 is ``tests/fsdp/test_fully_shard.py``'s.)
"""

from __future__ import annotations

import pytest
import torch

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import resume_cases
from tests.fsdp.feature_cases import assert_bitwise
from tests.fsdp.resume_cases import RESUME_AT, STEPS

pytestmark = [pytest.mark.gloo, pytest.mark.slow]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, list[dict]]:
    """The three spawned runs, in order, sharing one checkpoint directory."""
    directory = str(tmp_path_factory.mktemp("checkpoints"))
    return {
        "two": run_on_local_ranks(resume_cases.save_at_two_ranks, 2, directory, timeout_s=60),
        "four": run_on_local_ranks(resume_cases.reshard_at_four_ranks, 4, directory, timeout_s=60),
        "resume": run_on_local_ranks(resume_cases.resume_at_two_ranks, 2, directory, timeout_s=300),
    }


def assert_same_state(saved: dict, loaded: dict, what: str) -> None:
    assert_bitwise(saved["params"], loaded["params"], f"{what}: parameters")
    assert [k for k, _ in loaded["optim"]] == [k for k, _ in saved["optim"]]
    assert {k for k, _ in saved["optim"]} == {"step", "exp_avg", "exp_avg_sq"}
    assert_bitwise([v for _, v in saved["optim"]], [v for _, v in loaded["optim"]],
                   f"{what}: optimizer state")


def test_dcp_round_trip_is_bitwise(runs):
    for result in runs["two"]:
        # The loading run starts elsewhere, so equality is the load's doing.
        assert not any(torch.equal(a, b) for a, b in
                       zip(result["before_load"]["params"], result["saved"]["params"]))
        assert_same_state(result["saved"], result["loaded"], "2 ranks -> 2 ranks")
        steps = [v for k, v in result["loaded"]["optim"] if k == "step"]
        assert all(s.item() == RESUME_AT for s in steps)


def test_resumed_run_follows_uninterrupted_run_bitwise(runs):
    for uninterrupted, resumed in zip(runs["two"], runs["resume"]):
        assert len(resumed["resumed_losses"]) == STEPS - RESUME_AT
        assert resumed["resumed_losses"] == uninterrupted["losses"][RESUME_AT:]
        assert_same_state(uninterrupted["final"], resumed["resumed_final"], "after resuming")


def test_checkpoint_from_2_ranks_loads_at_4_bitwise(runs):
    saved = runs["two"][0]["saved"]
    for rank, result in enumerate(runs["four"]):
        assert_same_state(saved, result["loaded_from_2"], f"2 -> 4 ranks, rank {rank}")


def test_checkpoint_from_4_ranks_loads_at_2_bitwise(runs):
    saved = runs["four"][0]["saved"]
    # The 4-rank run's own state differs from the 2-rank one's (other data, other order).
    assert not all(torch.equal(a, b) for a, b in
                   zip(saved["params"], runs["two"][0]["saved"]["params"]))
    for rank, result in enumerate(runs["resume"]):
        assert_same_state(saved, result["loaded_from_4"], f"4 -> 2 ranks, rank {rank}")


def test_same_seed_gives_bitwise_identical_losses(runs):
    for first, second in zip(runs["two"], runs["resume"]):
        assert second["rerun_losses"] == first["losses"]

