"""A rank that fails mid-step makes the other rank fail with a clear error, never hang.

Two gloo ranks train a fully_shard-ed model (``fault_cases``) under a 10 s collective
timeout, set with ``dist.init_process_group(timeout=...)``. At step 1 rank 1 exits
(``os._exit(1)``) or raises, inside block 1's forward or before backward, eager and
under ``torch.compile(fullgraph=True)``, or exits inside block 0's forward (a
prefetched all-gather in flight) or block 1's backward (a reduce-scatter in flight).
Rank 0 must then raise: "connection closed" when rank 1's process is gone, a timeout
naming the 10 s when rank 1 is still alive with its process group open. The ranks are
processes this test starts and joins with a deadline, killing any still alive, so a
hang fails the test instead of stalling it.
"""

from __future__ import annotations

import json
import os
import re

import pytest

from fsdp_traceable.testing.local_ranks import free_port, local_rank_context
from tests.fsdp.fault_cases import FAULT_STEP, FAULTY_RANK, outcome_path, run_rank

TIMEOUT_S = 10
# Generous: start-up, a compile of a few seconds to a minute on 2 shared cores, and
# one collective timeout. Only a hang gets near it.
JOIN_DEADLINE_S = 240
PEER_GONE = r"(?i)connection (closed|reset|refused)|socket closed|broken pipe|end of file|peer"
# Their 10 s collective timeout must not be spent waiting for CPU: run alone.
pytestmark = [pytest.mark.gloo, pytest.mark.serial]


def run_scenario(mode: str, where: str, kind: str, out_dir: str) -> list[dict]:
    """Runs both ranks as child processes; returns each rank's outcome plus exit code.

    A rank still alive at the deadline is killed and marked ``hung``.
    """
    context = local_rank_context()
    port = free_port()
    processes = [
        context.Process(target=run_rank,
                        args=(rank, 2, port, mode, where, kind, out_dir, TIMEOUT_S))
        for rank in range(2)
    ]
    for process in processes:
        process.start()
    outcomes = []
    for rank, process in enumerate(processes):
        process.join(JOIN_DEADLINE_S if rank == 0 else 30)
        hung = process.is_alive()
        if hung:
            process.kill()
            process.join(10)
        path = outcome_path(out_dir, rank)
        outcome = {}
        if os.path.exists(path):
            with open(path) as f:
                outcome = json.load(f)
        outcomes.append({**outcome, "hung": hung, "exitcode": process.exitcode})
    return outcomes


SCENARIOS = [
    ("eager", "block1", "exit"),
    # Block 1's all-gather, prefetched by block 0's forward, is in flight.
    ("eager", "block0", "exit"),
    # Block 2's reduce-scatter (async, finished by the next reduction) is in flight.
    ("eager", "block1_backward", "exit"),
    ("eager", "block1", "raise"),
    ("eager", "before_backward", "raise_and_linger"),
    ("compile", "block1", "exit"),
    ("compile", "block1", "raise_and_linger"),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode,where,kind", SCENARIOS)
def test_surviving_rank_raises_clear_error_without_hanging(mode, where, kind, tmp_path):
    survivor, faulty = run_scenario(mode, where, kind, str(tmp_path))
    assert not survivor["hung"], f"rank 0 hung: {survivor}"
    assert not faulty["hung"], f"rank {FAULTY_RANK} hung: {faulty}"

    if kind == "exit":
        assert faulty["exitcode"] == 1 and "status" not in faulty
    else:
        assert faulty["type"] == "InjectedFault" and f"in {where}" in faulty["message"]
        assert faulty["steps_done"] == FAULT_STEP
        assert faulty["exitcode"] == (1 if kind == "raise" else 0)

    assert survivor["status"] == "raised", survivor
    assert "RuntimeError" in survivor["bases"], survivor
    assert survivor["steps_done"] == FAULT_STEP  # failed in the faulty step, not later
    if kind == "raise_and_linger":
        # The peer is alive and silent: only the collective timeout can end the wait.
        assert f"{TIMEOUT_S * 1000}ms" in survivor["message"], survivor["message"]
    else:
        assert re.search(PEER_GONE, survivor["message"]), survivor["message"]
    assert survivor["exitcode"] == 0  # it also shut down cleanly after the error
