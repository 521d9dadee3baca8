"""PP + FSDP on a (pp=2, dp=2) mesh of 4 gloo ranks against torch's FSDP2: stages of
``fully_shard``-ed blocks driven by ``torch.distributed.pipelining``'s ``ScheduleGPipe``,
``Schedule1F1B`` and ``ScheduleInterleaved1F1B`` (two stages per rank), 2 SGD steps each;
last-stage losses and every rank's final shards bit for bit, and the same all-gathers
and reduce-scatters per step. One launch runs everything; the tests read its result.
Also, on one process: what the stage code finds at ``fully_shard.state(module)``, and
the clear error for no-sync accumulation through a module compiled by itself."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_traceable
from fsdp_traceable.fsdp.module_state import FSDPModuleState
from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp.features import pipeline_parallel_cases as cases


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_on_local_ranks(cases.pipeline_parity, 4, timeout_s=300)


def _per_rank(results: list[dict], schedule: str):
    """``(rank, theirs, ours)`` for every rank's run of ``schedule``."""
    for rank, result in enumerate(results):
        yield rank, result[schedule]["theirs"], result[schedule]["ours"]


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_last_stage_losses_match_fsdp2(results, schedule):
    for rank, theirs, ours in _per_rank(results, schedule):
        assert ours["losses"] == theirs["losses"], f"rank {rank}"
        last_stage = rank >= 2  # (pp, dp) mesh: pp rank 1 holds the last stage
        expected = cases.MICROBATCHES if last_stage else 0
        assert [len(step) for step in ours["losses"]] == [expected] * cases.STEPS
    assert results[2][schedule]["ours"]["losses"][0] != results[2][schedule]["ours"]["losses"][1]


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_final_shards_match_fsdp2_bitwise(results, schedule):
    for rank, theirs, ours in _per_rank(results, schedule):
        assert list(ours["shards"]) == list(theirs["shards"]), f"rank {rank}"
        for name, shard in theirs["shards"].items():
            assert torch.equal(ours["shards"][name], shard), f"rank {rank} {schedule} {name}"


@pytest.mark.gloo
@pytest.mark.parametrize("schedule", list(cases.SCHEDULES))
def test_same_collectives_per_step_as_fsdp2(results, schedule):
    for rank, theirs, ours in _per_rank(results, schedule):
        assert ours["counts"] == theirs["counts"], f"rank {rank}"
        stages_per_rank = cases.SCHEDULES[schedule][1]
        # One reduce-scatter per group per step (microbatches accumulate unsharded):
        # per stage, the root (the stage's own parameter) and one per block.
        blocks_per_stage = cases.N_BLOCKS // (2 * stages_per_rank)
        expected = stages_per_rank * (1 + blocks_per_stage)
        assert [c["reduce_scatter"] for c in ours["counts"]] == [expected] * cases.STEPS


def _sharded_stage(mesh) -> cases.Stage:
    stage = cases.Stage([cases.Block(), cases.Block()])
    for block in stage.layers:
        fsdp_traceable.fully_shard(block, mesh=mesh)
    fsdp_traceable.fully_shard(stage, mesh=mesh)
    return stage


def test_fully_shard_state_is_what_pipeline_stages_reach_for(fake_mesh):
    stage = _sharded_stage(fake_mesh)
    state = torch.distributed.fsdp.fully_shard.state(stage)
    assert isinstance(state, FSDPModuleState)
    # The stage's root first, then each block (pre-order), one parameter group each.
    states = state._state_ctx.all_states
    assert states == [torch.distributed.fsdp.fully_shard.state(m)
                      for m in (stage, *stage.layers)]
    for each in states:
        (group,) = each._fsdp_param_groups
        group.post_backward()  # nothing accumulated: nothing to reduce, no collective
    state._root_post_backward_final_callback()
    assert all(p.grad is None for p in stage.parameters())


def test_no_sync_through_a_module_compiled_before_fully_shard_raises(fake_mesh):
    stage = _sharded_stage(fake_mesh)
    # torch's own Module.compile, as a compile before fully_shard leaves it (lazy:
    # nothing is compiled here): the graph would hold the group's collectives.
    nn.Module.compile(stage.layers[1])
    with pytest.raises(NotImplementedError,
                       match=r"set_requires_gradient_sync\(False\) with the module of group "
                             r"'layers.1'.*before fully_shard"):
        stage.set_requires_gradient_sync(False)
    stage.set_requires_gradient_sync(True)
    stage.layers[0].set_requires_gradient_sync(False)  # an eager module: accepted
    stage.layers[0].compile()  # compiles the compute alone: no-sync still accepted
    stage.layers[0].set_requires_gradient_sync(False)
