"""PP + FSDP on a (pp=2, dp=2) mesh of 4 gloo ranks against torch's FSDP2: stages of
``fully_shard``-ed blocks driven by ``torch.distributed.pipelining``'s ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` (two stages per rank), 2 SGD steps each;
last-stage losses and every rank's final shards bit for bit, and the same all-gathers
and reduce-scatters per step. One launch runs everything; the tests read its result."""

from __future__ import annotations

import pytest
import torch

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import pipeline_parallel_cases as cases

pytestmark = pytest.mark.gloo


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_local_ranks(cases.pipeline_parity, 4, timeout_s=300)


@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_last_stage_losses_match_fsdp2(results, schedule):
    for rank, result in enumerate(results):
        theirs, ours = result[schedule]["theirs"], result[schedule]["ours"]
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        last_stage = rank >= 2  # (pp, dp) mesh: pp rank 1 holds the last stage
        expected = cases.MICROBATCHES if last_stage else 0
        assert [len(step) for step in ours["losses"]] == [expected] * cases.STEPS
    assert results[2][schedule]["ours"]["losses"][0] != results[2][schedule]["ours"]["losses"][1]


@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_final_shards_match_fsdp2_bitwise(results, schedule):
    for rank, result in enumerate(results):
        theirs, ours = result[schedule]["theirs"], result[schedule]["ours"]
        assert list(ours["shards"]) == list(theirs["shards"]), f"rank {rank}"
        for name, shard in theirs["shards"].items():
            assert torch.equal(ours["shards"][name], shard), f"rank {rank} {schedule} {name}"


@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_same_collectives_per_step_as_fsdp2(results, schedule):
    for rank, result in enumerate(results):
        theirs, ours = result[schedule]["theirs"], result[schedule]["ours"]
        assert ours["counts"] == theirs["counts"], f"rank {rank}"
        stages_per_rank = cases.SCHEDULES[schedule][1]
        # One reduce-scatter per group per step (microbatches accumulate unsharded):
        # per stage, the root (the stage's own parameter) and one per block.
        blocks_per_stage = cases.N_BLOCKS // (2 * stages_per_rank)
        expected = stages_per_rank * (1 + blocks_per_stage)
        assert [c["reduce_scatter"] for c in ours["counts"]] == [expected] * cases.STEPS
