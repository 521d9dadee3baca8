"""``unshard(async_op)`` / ``reshard()`` life cycle against FSDP2 on 2 and 3 gloo ranks.

``unshard()`` of every group before the forwards of two steps (synchronous, or async
with the handle waited once and left to the forward once), a plain third step, then a
bare ``unshard()``/``reshard()`` and a no-grad forward: the forward outputs (the one
after each optimizer step must use the new weights) and the parameters are FSDP2's,
bit for bit. Then ``unshard()`` and a forward issue FSDP2's all-gathers: the root's
parameters, kept since the no-grad forward, are not gathered again.
"""

from __future__ import annotations

from typing import Any

import pytest

from fsdp_traceable.testing.local_ranks import run_on_local_ranks
from tests.fsdp import parity_cases
from tests.fsdp.feature_cases import assert_bitwise, run_cases


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks(request) -> list[dict[str, Any]]:
    cases = [(f"async_{a}", parity_cases.unshard_life_cycle, (a,)) for a in (False, True)]
    return run_on_local_ranks(run_cases, request.param, cases, timeout_s=300)


@pytest.mark.gloo
@pytest.mark.parametrize("async_op", [False, True])
def test_unshard_life_cycle_matches_fsdp2(ranks, async_op: bool):
    for rank, per_rank in enumerate(ranks):
        result = per_rank[f"async_{async_op}"]
        assert "error" not in result, f"rank {rank}:\n{result.get('error')}"
        assert result["ours"]["sums"] == result["theirs"]["sums"]
        # After the no-grad forward: the same all-gathers (by size), the root's not among them.
        gathers = result["theirs"]["gathers_after_no_grad"]
        assert result["ours"]["gathers_after_no_grad"] == gathers
        assert len(gathers) == parity_cases.UNEVEN.n_layers
        assert_bitwise(result["theirs"]["params"], result["ours"]["params"], "parameters")
